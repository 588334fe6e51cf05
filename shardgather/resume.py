"""save_checkpoint / load_checkpoint: model + optimizer + your extra state in one
directory, streamed with bounded memory, loadable at any world size or FSDP flavour —
or into a plain model in a single process.

Layout of the directory::

    model.safetensors    the full model (clean keys, tied weights stored once)
    optim.safetensors    every element-wise optimizer state, keys "<state>/<param>"
    optim.json           param groups and scalar states (small; JSON, never pickled)
    extra.pt             what you passed as ``extra`` (epoch, step, RNG, scheduler...),
                         loaded with ``weights_only=True`` unless you pass trust_pickle=True

Loading validates every file of the directory before the model or the optimizer
changes, so a damaged optimizer file cannot leave a half-loaded model behind.
"""

from __future__ import annotations

import datetime
import io
import os
import pickle
import shutil
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._options import DEFAULT_TIMEOUT
from ._save import file_set, save_plan
from .api import all_ok
from .checkpoint import load_full_state_dict, save_full_state_dict
from .errors import CheckpointError, CollectiveError, ShardGatherError
from .io import json_values
from .io.publish import publish_dir
from .io.safetensors_format import read_header
from .optim import FileState, check_saved_state, load_full_optim_state_dict, state_plan

MODEL_FILE, OPTIM_FILE, OPTIM_META, EXTRA_FILE = (
    "model.safetensors",
    "optim.safetensors",
    "optim.json",
    "extra.pt",
)
LEGACY_OPTIM_META = "optim.pt"  # before 0.2: the same content, torch.save'd


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _broadcast(obj: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _write_durably(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


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
    optimizer state included (it is streamed the same way). The optimizer's param
    groups and scalar states are stored as JSON (no pickle); ``extra`` with
    ``torch.save`` — :func:`load_checkpoint` reads it back with ``weights_only=True``
    (tensors, numbers, strings, lists, dicts) unless told to trust the file.
    ``shared_filesystem``: as for :func:`save_full_state_dict`.

    Raises:
        ShardGatherError: a param group holds a value JSON cannot carry.
        CheckpointError / CollectiveError: nothing was written (see the message).

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
                file_set(st.plan, os.path.join(tmp, OPTIM_FILE)),
                timeout=timeout,
                shared_filesystem=shared_filesystem,
                what="save_checkpoint",
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
                meta = {"param_groups": st.param_groups, "scalars": scalars, "elements": elems}
                _write_durably(
                    os.path.join(tmp, OPTIM_META), json_values.dumps(meta, "optimizer state")
                )
        if _rank() == 0:
            buf = io.BytesIO()
            torch.save(extra or {}, buf)
            _write_durably(os.path.join(tmp, EXTRA_FILE), buf.getvalue())
            publish_dir(tmp, final)
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        if _rank() == 0 and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        if not dist.is_initialized() or isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
    failures = all_ok(not error, error)
    if failures:
        if _rank() == 0 and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        raise CollectiveError(f"save_checkpoint({final!r}) failed: " + "; ".join(failures))


@dataclass
class _SavedOptimizer:
    """A checkpoint directory's optimizer state, validated, not yet loaded."""

    param_groups: list[dict[str, Any]]
    state: FileState
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    elements: dict[str, list[str]]


def _read_optimizer(root: str, trust_pickle: bool) -> _SavedOptimizer:
    """Read and validate optim.json (or a legacy optim.pt, without unpickling code) and
    the header of optim.safetensors; nothing is loaded yet."""
    optim_file = os.path.join(root, OPTIM_FILE)
    meta_file = os.path.join(root, OPTIM_META)
    legacy = os.path.join(root, LEGACY_OPTIM_META)
    if not os.path.isfile(optim_file) or not (os.path.isfile(meta_file) or os.path.isfile(legacy)):
        raise CheckpointError(f"{root}: saved without optimizer state; pass optimizer=None")
    if os.path.isfile(meta_file):
        with open(meta_file, "rb") as f:
            meta = json_values.loads(f.read(), meta_file)
    else:
        meta = _torch_load(legacy, trust_pickle)
    if not (
        isinstance(meta, dict)
        and isinstance(meta.get("param_groups"), list)
        and isinstance(meta.get("scalars"), dict)
        and isinstance(meta.get("elements"), dict)
        and all(isinstance(v, dict) for v in meta["scalars"].values())
        and all(
            isinstance(v, list) and all(isinstance(n, str) for n in v)
            for v in meta["elements"].values()
        )
    ):
        raise CheckpointError(
            f"{root}: corrupt optimizer metadata (want param_groups, scalars, elements)"
        )
    header = read_header(optim_file)
    stored = set(header.tensors)
    wanted = {f"{n}/{k}" for k, names in meta["elements"].items() for n in names}
    if wanted != stored:
        raise CheckpointError(
            f"{optim_file} does not match {os.path.basename(meta_file)}: missing "
            f"{sorted(wanted - stored)[:5]}, unexpected {sorted(stored - wanted)[:5]}"
        )
    shapes = {k: (t.shape, t.dtype) for k, t in header.tensors.items()}
    state = FileState(optim_file, header, meta["scalars"], meta["elements"])
    return _SavedOptimizer(meta["param_groups"], state, shapes, meta["elements"])


def _torch_load(path: str, trust_pickle: bool) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path} holds objects that only full unpickling can rebuild, which could run "
            "code from the file. If you trust this checkpoint, pass trust_pickle=True. "
            f"({str(exc).splitlines()[0]})"
        ) from None
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot be read ({type(exc).__name__}: {exc})") from None


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    trust_pickle: bool = False,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> dict[str, Any]:
    """Load a directory written by :func:`save_checkpoint` into ``model`` (and
    ``optimizer``); returns the ``extra`` dict. Works at any world size and FSDP
    flavour, and for a plain model in one process with no process group.

    Every file is validated first — headers, optimizer metadata, the match with the
    model and the optimizer, ``extra`` — so a bad file raises before anything changes.
    Nothing is unpickled: ``extra.pt`` is read with ``weights_only=True``.

    Args:
        trust_pickle: read ``extra.pt`` (and a pre-0.2 ``optim.pt``) with full
            unpickling, for ``extra`` holding arbitrary objects. Only for checkpoints
            you trust: unpickling runs code.

    Raises:
        CheckpointError: not a checkpoint directory, a file is missing or corrupt, or
            ``extra`` needs ``trust_pickle=True``.
        StateDictMismatchError: the model or optimizer does not match.
    """
    root = os.fspath(path)
    model_file = os.path.join(root, MODEL_FILE)
    error: ShardGatherError | None = None
    extra: Any = {}
    saved: _SavedOptimizer | None = None
    try:
        if not os.path.isfile(model_file):
            raise CheckpointError(f"{root}: not a shardgather checkpoint ({MODEL_FILE} missing)")
        read_header(model_file)
        if optimizer is not None:
            saved = _read_optimizer(root, trust_pickle)
            check_saved_state(model, optimizer, saved.param_groups, saved.shapes, saved.elements)
        extra_file = os.path.join(root, EXTRA_FILE)
        if os.path.isfile(extra_file):
            extra = _torch_load(extra_file, trust_pickle)
    except ShardGatherError as exc:
        error = exc
    # Every rank validated the same files; all raise, or none does (no rank is left
    # waiting in a collective that the others never reach).
    failures = all_ok(error is None, str(error))
    if failures:
        if error is not None:
            raise error
        raise CheckpointError(f"load_checkpoint({root!r}): " + "; ".join(failures))
    load_full_state_dict(model, model_file, strict=strict, timeout=timeout)
    if optimizer is not None:
        assert saved is not None
        osd = {"state": saved.state, "param_groups": saved.param_groups}
        load_full_optim_state_dict(model, optimizer, osd, timeout=timeout)
    return extra
