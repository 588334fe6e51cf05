"""Small Python values as JSON, exactly and without pickle: the metadata of a
checkpoint directory (optimizer param groups, scalar states such as ``step``).

JSON has no tuples, tensors or dtypes, so those travel tagged: ``{"__tuple__": [...]}``,
``{"__tensor__": {"dtype", "shape", "hex"}}`` (the raw little-endian bytes, so any
dtype round-trips bit-exactly), ``{"__dtype__": "float32"}``; a dict that itself has a
key starting with ``__`` is wrapped as ``{"__dict__": [[key, value], ...]}``. Floats
round-trip exactly (``repr``), NaN and infinities included. Decoding trusts nothing:
anything else is a :class:`CheckpointError`.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ..errors import CheckpointError, ShardGatherError

_TAGS = ("__tuple__", "__tensor__", "__dtype__", "__dict__")
MAX_TENSOR_BYTES = 2**20  # scalars and small states; large tensors belong in safetensors


def encode(value: Any, where: str = "value") -> Any:
    """``value`` as a JSON-ready structure.

    Raises:
        ShardGatherError: a value JSON cannot carry exactly (e.g. an arbitrary object).
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, where) for v in value]}
    if isinstance(value, list):
        return [encode(v, where) for v in value]
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).replace("torch.", "")}
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        if t.numel() * t.element_size() > MAX_TENSOR_BYTES:
            raise ShardGatherError(f"{where}: a {tuple(t.shape)} tensor is too large for metadata")
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        return {
            "__tensor__": {
                "dtype": str(t.dtype).replace("torch.", ""),
                "shape": list(t.shape),
                "hex": bytes(raw.numpy()).hex(),
            }
        }
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ShardGatherError(f"{where}: only str dict keys can be stored without pickle")
        if any(k.startswith("__") for k in value):
            return {"__dict__": [[k, encode(v, f"{where}.{k}")] for k, v in value.items()]}
        return {k: encode(v, f"{where}.{k}") for k, v in value.items()}
    raise ShardGatherError(
        f"{where}: a {type(value).__name__} cannot be stored without pickle; checkpoint "
        "metadata holds numbers, strings, bools, None, lists, tuples, dicts and small tensors"
    )


def decode(obj: Any, where: str) -> Any:
    """The value :func:`encode` made. Raises CheckpointError on anything malformed."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [decode(v, where) for v in obj]
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where}: unexpected JSON value {obj!r}")
    tags = [t for t in _TAGS if t in obj]
    if not tags:
        return {k: decode(v, where) for k, v in obj.items()}
    if len(obj) != 1:
        raise CheckpointError(f"{where}: malformed tagged value {obj!r}")
    tag, body = tags[0], obj[tags[0]]
    if tag == "__tuple__" and isinstance(body, list):
        return tuple(decode(v, where) for v in body)
    if tag == "__dict__" and isinstance(body, list):
        if not all(isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], str) for kv in body):
            raise CheckpointError(f"{where}: malformed __dict__ value")
        return {k: decode(v, where) for k, v in body}
    if tag == "__dtype__":
        return _dtype(body, where)
    if tag == "__tensor__" and isinstance(body, dict):
        return _tensor(body, where)
    raise CheckpointError(f"{where}: malformed {tag} value {body!r}")


def _dtype(name: Any, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{where}: unknown dtype {name!r}")
    return dtype


def _tensor(body: dict[str, Any], where: str) -> torch.Tensor:
    dtype = _dtype(body.get("dtype"), where)
    shape, hexed = body.get("shape"), body.get("hex")
    if (
        not isinstance(shape, list)
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        or not isinstance(hexed, str)
    ):
        raise CheckpointError(f"{where}: malformed tensor {body!r}")
    try:
        raw = bytes.fromhex(hexed)
    except ValueError:
        raise CheckpointError(f"{where}: malformed tensor bytes") from None
    numel = 1
    for d in shape:
        numel *= d
    if len(raw) != numel * dtype.itemsize or len(raw) > MAX_TENSOR_BYTES:
        raise CheckpointError(
            f"{where}: a {dtype} tensor of shape {shape} needs {numel * dtype.itemsize} "
            f"bytes, the file holds {len(raw)}"
        )
    flat = (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if raw
        else torch.empty(0, dtype=torch.uint8)
    )
    return flat.view(dtype).reshape(shape).clone()


def dumps(value: Any, where: str = "value") -> bytes:
    return json.dumps(encode(value, where), allow_nan=True).encode()


def loads(raw: bytes, where: str) -> Any:
    try:
        return decode(json.loads(raw.decode()), where)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{where}: not valid JSON ({exc})") from None
