"""save_checkpoint / load_checkpoint: model + optimizer + your extra state in one
directory, streamed with bounded memory, loadable at any world size or FSDP flavour —
or into a plain model in a single process.

Layout of the directory::

    model.safetensors    the full model (clean keys, tied weights stored once)
    optim.safetensors    every element-wise optimizer state, keys "<state>/<param>"
    optim.pt             param groups and scalar states (small)
    extra.pt             what you passed as ``extra`` (epoch, step, RNG, scheduler...)
"""

from __future__ import annotations

import datetime
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .api import DEFAULT_TIMEOUT
from .checkpoint import load_full_state_dict, save_full_state_dict, save_plan
from .errors import CheckpointError, CollectiveError
from .optim import load_full_optim_state_dict, state_plan

MODEL_FILE, OPTIM_FILE, OPTIM_META, EXTRA_FILE = (
    "model.safetensors",
    "optim.safetensors",
    "optim.pt",
    "extra.pt",
)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _broadcast(obj: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    shared_filesystem: bool = False,
) -> None:
    """Save model, optimizer state and ``extra`` to the directory ``path``, atomically.

    Call on every rank. Everything is written into a temporary directory beside
    ``path`` and renamed at the end: a failure leaves ``path`` as it was. Peak extra
    host memory per rank stays at the staging bound of save_full_state_dict, the
    optimizer state included (it is streamed the same way). ``shared_filesystem``: as
    for :func:`save_full_state_dict`.

    Example:
        >>> shardgather.save_checkpoint("ckpt/step_1000", model, optimizer,
        ...                             extra={"step": 1000, "rng": torch.get_rng_state()})
    """
    final = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(final)
    tmp = _broadcast(
        os.path.join(parent, f".{os.path.basename(final)}.tmp-{uuid.uuid4().hex[:8]}")
        if _rank() == 0
        else None
    )
    made = ""
    if _rank() == 0:
        try:
            os.makedirs(tmp)
        except OSError as exc:
            made = f"rank 0 cannot create {tmp!r}: {exc}"
    made = _broadcast(made)  # every rank learns it before any collective
    if made:
        raise CheckpointError(
            f"save_checkpoint({final!r}): {made}. Check that the parent directory exists "
            "and is writable on rank 0; nothing was written."
        )
    error = ""
    try:
        save_full_state_dict(
            model,
            os.path.join(tmp, MODEL_FILE),
            timeout=timeout,
            shared_filesystem=shared_filesystem,
        )
        if optimizer is not None:
            st = state_plan(model, optimizer, timeout)
            save_plan(
                st.plan,
                os.path.join(tmp, OPTIM_FILE),
                timeout=timeout,
                shared_filesystem=shared_filesystem,
            )
            if _rank() == 0:
                scalars = {
                    k: {n: d[1] for n, d in names.items() if d[0] == "scalar"}
                    for k, names in st.meta.items()
                }
                elems = {
                    k: sorted(n for n, d in names.items() if d[0] == "elem")
                    for k, names in st.meta.items()
                }
                torch.save(
                    {"param_groups": st.param_groups, "scalars": scalars, "elements": elems},
                    os.path.join(tmp, OPTIM_META),
                )
        if _rank() == 0:
            torch.save(extra or {}, os.path.join(tmp, EXTRA_FILE))
            _publish(tmp, final)
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        if _rank() == 0 and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        if not dist.is_initialized() or isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
    from .api import _all_ok

    failures = _all_ok(not error, error)
    if failures:
        if _rank() == 0 and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        raise CollectiveError(f"save_checkpoint({final!r}) failed: " + "; ".join(failures))


def _publish(tmp: str, final: str) -> None:
    """Rename the finished directory into place (replacing an older one)."""
    old = None
    if os.path.exists(final):
        old = f"{final}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
    os.rename(tmp, final)
    fd = os.open(os.path.dirname(final), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class _LazyState(Mapping):
    """``{param: {state: tensor}}`` read from optim.safetensors one parameter at a
    time, so loading never holds more than one parameter's state in memory."""

    def __init__(self, path: str, meta: dict[str, Any]) -> None:
        from safetensors import safe_open

        self._file = safe_open(path, framework="pt")
        self._scalars: dict[str, dict[str, Any]] = meta["scalars"]
        self._elements: dict[str, list[str]] = meta["elements"]

    def __getitem__(self, key: str) -> dict[str, Any]:
        if key not in self._elements and key not in self._scalars:
            raise KeyError(key)
        out = dict(self._scalars.get(key, {}))
        for name in self._elements.get(key, []):
            out[name] = self._file.get_tensor(f"{name}/{key}")
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(set(self._elements) | set(self._scalars)))

    def __len__(self) -> int:
        return len(set(self._elements) | set(self._scalars))


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> dict[str, Any]:
    """Load a directory written by :func:`save_checkpoint` into ``model`` (and
    ``optimizer``); returns the ``extra`` dict. Works at any world size and FSDP
    flavour, and for a plain model in one process with no process group.

    Raises:
        CheckpointError: not a checkpoint directory, or a file is missing or corrupt.
        StateDictMismatchError: the model or optimizer does not match.
    """
    root = os.fspath(path)
    model_file = os.path.join(root, MODEL_FILE)
    if not os.path.isfile(model_file):
        raise CheckpointError(f"{root}: not a shardgather checkpoint ({MODEL_FILE} missing)")
    load_full_state_dict(model, model_file, strict=strict, timeout=timeout)
    if optimizer is not None:
        meta_file, optim_file = os.path.join(root, OPTIM_META), os.path.join(root, OPTIM_FILE)
        if not (os.path.isfile(meta_file) and os.path.isfile(optim_file)):
            raise CheckpointError(f"{root}: saved without optimizer state; pass optimizer=None")
        meta = torch.load(meta_file, weights_only=False)
        osd = {"state": _LazyState(optim_file, meta), "param_groups": meta["param_groups"]}
        load_full_optim_state_dict(model, optimizer, osd, timeout=timeout)
    extra_file = os.path.join(root, EXTRA_FILE)
    # Your own file (it may hold RNG states or scheduler objects): full unpickling.
    return torch.load(extra_file, weights_only=False) if os.path.isfile(extra_file) else {}
