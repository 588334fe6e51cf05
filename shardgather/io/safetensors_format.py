"""The safetensors format, streamed: the header is computed from the plan before
any data moves, then data is written/read by byte ranges (pwrite/pread).

Layout: 8-byte little-endian header length N, N bytes of JSON
(``{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``,
offsets relative to the data section), then the raw row-major little-endian bytes.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import torch

from ..errors import CheckpointError

DTYPE_TO_ST = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _st in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
    ("complex64", "C64"),
):
    if hasattr(torch, _name):
        DTYPE_TO_ST[getattr(torch, _name)] = _st
ST_TO_DTYPE = {v: k for k, v in DTYPE_TO_ST.items()}
ALIASES_KEY = "shardgather.aliases"
MAX_HEADER = 100 * 2**20  # safetensors' own limit


@dataclass
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offset
    end: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class Header:
    tensors: dict[str, TensorInfo]  # stored keys, file order
    metadata: dict[str, str]
    aliases: dict[str, str]  # alias -> stored key
    data_start: int
    file_size: int

    def all_keys(self) -> list[str]:
        return list(self.tensors) + [a for a in self.aliases if a not in self.tensors]

    def resolve(self, key: str) -> TensorInfo:
        return self.tensors[self.aliases.get(key, key)]


def st_dtype(dtype: torch.dtype, key: str) -> str:
    try:
        return DTYPE_TO_ST[dtype]
    except KeyError:
        raise CheckpointError(f"{key!r}: dtype {dtype} has no safetensors equivalent") from None


def encode_header(
    layout: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]],
    metadata: dict[str, str],
) -> bytes:
    """Header bytes (length prefix included), padded so the data starts 8-byte aligned.

    Args:
        layout: stored key -> (dtype, shape, begin, end) relative to the data section.
    """
    obj: dict[str, object] = {}
    if metadata:
        obj["__metadata__"] = metadata
    for key, (dtype, shape, begin, end) in layout.items():
        obj[key] = {
            "dtype": st_dtype(dtype, key),
            "shape": list(shape),
            "data_offsets": [begin, end],
        }
    raw = json.dumps(obj, separators=(",", ":")).encode()
    raw += b" " * ((8 - (len(raw) + 8) % 8) % 8)
    return struct.pack("<Q", len(raw)) + raw


def read_header(path: str | os.PathLike) -> Header:
    """Parse and validate a safetensors header without reading any tensor data.

    Raises:
        CheckpointError: missing, truncated, corrupt, or not a safetensors file.
    """
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: {size} bytes is too short to be a safetensors file")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER or 8 + n > size:
                raise CheckpointError(
                    f"{path}: not a safetensors file, or truncated (header length {n}, file size "
                    f"{size}). If it is a torch.save file, pass it as a .pt/.bin path."
                )
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc})") from exc
    try:
        obj = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header ({exc})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = obj.pop("__metadata__", None) or {}
    data_start = 8 + n
    tensors: dict[str, TensorInfo] = {}
    for key, info in sorted(
        obj.items(),
        key=lambda kv: kv[1].get("data_offsets", [0])[0] if isinstance(kv[1], dict) else 0,
    ):
        try:
            dtype = ST_TO_DTYPE[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{path}: corrupt or unsupported header entry for {key!r}: {info}"
            ) from None
        t = TensorInfo(dtype, shape, data_start + begin, data_start + end)
        if end - begin != t.numel * dtype.itemsize or begin > end:
            raise CheckpointError(f"{path}: header entry {key!r} has inconsistent size")
        if t.end > size:
            raise CheckpointError(
                f"{path}: truncated: {key!r} ends at byte {t.end} but the file has {size} bytes. "
                "The file was not completely written; save it again."
            )
        tensors[key] = t
    aliases = json.loads(metadata.get(ALIASES_KEY, "{}")) if metadata else {}
    return Header(tensors, dict(metadata), aliases, data_start, size)


def pread_into(fd: int, buf: torch.Tensor, offset: int) -> None:
    """Fill the uint8 tensor ``buf`` from the file at ``offset`` (no intermediate copy)."""
    view = memoryview(buf.numpy()).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(f"unexpected end of file at byte {offset + done}")
        done += n


def pwrite_from(fd: int, buf: torch.Tensor, offset: int) -> None:
    view = memoryview(buf.numpy()).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
