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
changes, so a damaged optimizer file cannot leave a half-loaded model behind; the
optimizer changes only after every rank has read its state.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import pickle
import re
import shutil
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._dist import Call
from ._engine import load as L
from ._engine import run, snapshot
from ._engine.optim_state import state_plan
from ._engine.sinks import Files, file_set
from ._engine.snapshot import AsyncSave
from ._options import DEFAULT_TIMEOUT, Options, check_model
from ._plan import GatherPlan, build_plan, reshard_for_load
from ._plan import optim as O
from ._plan.subset import KeySelection
from ._progress import Progress
from .errors import CheckpointError, ShardGatherError, StateDictMismatchError
from .io import json_values
from .io.publish import publish_dir
from .io.safetensors_format import read_header
from .io.sources import stored_tensors
from .io.stored import StoredTensor

MODEL_FILE, OPTIM_FILE, OPTIM_META, EXTRA_FILE = (
    "model.safetensors",
    "optim.safetensors",
    "optim.json",
    "extra.pt",
)
SUBSET = "shardgather.subset"  # model file metadata: a keys= checkpoint
LEGACY_OPTIM_META = "optim.pt"  # before 0.2: the same content, torch.save'd


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
    blocking: bool = True,
    in_flight: str = "wait",
    reuse_staging: bool = True,
    write_mb_per_s: float | None = None,
    progress: bool = False,
    keys: KeySelection | None = None,
) -> AsyncSave | None:
    """Save model, optimizer state and ``extra`` to the directory ``path``, atomically.

    Call on every rank. Everything is written into a temporary directory beside
    ``path`` and renamed at the end: a failure leaves ``path`` as it was. Peak extra
    host memory per rank stays at the staging bound of save_full_state_dict, the
    optimizer state included (it is streamed the same way). The optimizer's param
    groups and scalar states are stored as JSON (no pickle); ``extra`` with
    ``torch.save`` — :func:`load_checkpoint` reads it back with ``weights_only=True``
    (tensors, numbers, strings, lists, dicts) unless told to trust the file.
    ``shared_filesystem``: as for :func:`save_full_state_dict`.

    ``blocking=False``: as for :func:`save_full_state_dict` — every rank copies its own
    shard of the model and of the optimizer state aside (``extra`` is serialised now),
    the optimizer may step at once, and the returned :class:`AsyncSave`'s ``wait()``
    (on every rank, or the next save of the model) publishes the directory.
    ``keys``: the model's tensors to store (as for :func:`shardgather.full_state_dict`;
    e.g. ``"trainable"``: a LoRA run's adapter and its optimizer state, not the frozen
    base, which the run reloads from where it came from); :func:`load_checkpoint` then
    loads those and leaves the rest of the model as it is.
    ``in_flight``, ``reuse_staging``, ``write_mb_per_s``: as there. ``progress``: one
    tqdm bar on rank 0 for the model and the optimizer state, every rank's bytes
    (blocking saves; a background save's writes are not shown).

    Raises:
        ShardGatherError: a param group holds a value JSON cannot carry.
        CheckpointError / CollectiveError: nothing was written (see the message).

    Example:
        >>> shardgather.save_checkpoint("ckpt/step_1000", model, optimizer,
        ...                             extra={"step": 1000, "rng": torch.get_rng_state()})
    """
    opts = Options(
        timeout=timeout,
        shared_filesystem=shared_filesystem,
        in_flight=in_flight,
        write_mb_per_s=write_mb_per_s,
        progress=progress,
    )
    snapshot.settle(model, opts.in_flight)
    final = os.path.abspath(os.fspath(path))
    with Call("save_checkpoint", timeout) as call:
        plan = build_plan(check_model(model), keys=keys)
        subset = keys is not None
        st = state_plan(call, model, optimizer) if optimizer is not None else None
        small = _small_files(call, st, extra)  # their values at call time; checked first
        tmp = _temporary_dir(call, final)

        def remove() -> None:
            if call.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)

        try:
            if blocking:
                total = run.plan_bytes(plan) + (run.plan_bytes(st.plan) if st else 0)
                with contextlib.closing(
                    Progress(call, opts.progress, total, "shardgather: save_checkpoint")
                ) as bar:
                    run.gather(call, plan, _files(plan, tmp, MODEL_FILE, subset), opts, bar)
                    if st is not None:
                        run.gather(call, st.plan, _files(st.plan, tmp, OPTIM_FILE), opts, bar)
                for name, data in small.items():
                    _write_durably(os.path.join(tmp, name), data)
                if call.rank == 0:
                    publish_dir(tmp, final)
                call.round("published")
                return None
            keep: list[Any] = []
            laters = [
                snapshot.gather_later(
                    call,
                    plan,
                    _files(plan, tmp, MODEL_FILE, subset),
                    opts,
                    snapshot.buffer_for(model, "model", keep, reuse_staging),
                )
            ]
            if st is not None:
                laters.append(
                    snapshot.gather_later(
                        call,
                        st.plan,
                        _files(st.plan, tmp, OPTIM_FILE),
                        opts,
                        snapshot.buffer_for(model, "optim", keep, reuse_staging),
                    )
                )
        except BaseException as exc:
            call.latch(exc)  # before the cleanup: a peer must find our error, not its effect
            remove()
            raise
    writes = [
        lambda name=name, data=data: _write_durably(os.path.join(tmp, name), data)
        for name, data in small.items()
    ]
    total = run.plan_bytes(plan) + (run.plan_bytes(st.plan) if st else 0)
    handle = AsyncSave(
        call,
        laters,
        background=writes,
        publish=lambda: publish_dir(tmp, final),
        abort=remove,
        owner=id(model),
        keep=keep,
        path=final,
        progress=Progress(call, opts.progress, total, "shardgather: save_checkpoint"),
    )
    return snapshot.start(model, handle)


def _files(plan: GatherPlan, tmp: str, name: str, subset: bool = False) -> Files:
    # A subset (keys=) says so in the header: its load leaves the other keys alone
    # instead of calling them missing.
    metadata = {SUBSET: "1"} if subset else None
    return Files(file_set(plan, os.path.join(tmp, name), metadata=metadata), what="save_checkpoint")


def _small_files(
    call: Call, st: O.StatePlan | None, extra: dict[str, Any] | None
) -> dict[str, bytes]:
    """Rank 0's small files, as bytes: the optimizer's groups and scalars (JSON) and
    ``extra`` (torch.save); other ranks write none."""
    if call.rank != 0:
        return {}
    out = {}
    if st is not None:
        meta = {"param_groups": st.param_groups, "scalars": st.scalars, "elements": st.elements}
        out[OPTIM_META] = json_values.dumps(meta, "optimizer state")
    buf = io.BytesIO()
    torch.save(extra or {}, buf)
    out[EXTRA_FILE] = buf.getvalue()
    # What load_checkpoint will read back without trust_pickle: refused here, before
    # anything is written, rather than after the save at the load.
    try:
        torch.load(io.BytesIO(out[EXTRA_FILE]), weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        what = found.group(1) if found else "an object outside torch's safe types"
        raise ShardGatherError(
            f"save_checkpoint: extra holds {what}, which load_checkpoint would refuse "
            "(rebuilding it means unpickling, which can run code); nothing was written. "
            "Store plain values instead (numbers, strings, lists, dicts, tensors: e.g. a "
            "datetime as its isoformat(), a scheduler as its state_dict()), or allow the "
            "class with torch.serialization.add_safe_globals([...]) where you save and load."
        ) from None
    return out


def _temporary_dir(call: Call, final: str) -> str:
    """Rank 0 makes the directory everything is written into; everyone learns its name."""
    tmp = None
    if call.rank == 0:
        tmp = os.path.join(
            os.path.dirname(final), f".{os.path.basename(final)}.tmp-{uuid.uuid4().hex[:8]}"
        )
        try:
            os.makedirs(tmp)
        except OSError as exc:
            raise CheckpointError(
                f"save_checkpoint({final!r}): rank 0 cannot create {tmp!r}: {exc}. Check that "
                "the parent directory exists and is writable on rank 0; nothing was written."
            ) from exc
    try:
        return call.round("directory", payload=tmp, gather="rank0", agree={"path": final})
    except BaseException as exc:
        call.latch(exc)  # before the cleanup (see Call.latch)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


@dataclass
class _SavedOptimizer:
    """A checkpoint directory's optimizer state, validated, not yet loaded."""

    param_groups: list[dict[str, Any]]
    scalars: dict[str, dict[str, Any]]
    elements: dict[str, list[str]]
    path: str


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
    return _SavedOptimizer(meta["param_groups"], meta["scalars"], meta["elements"], optim_file)


def _torch_load(path: str, trust_pickle: bool) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except pickle.UnpicklingError as exc:
        # torch's message is a terminal page (ANSI bold, tabs, two numbered options):
        # keep only what it names, in one plain sentence.
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        what = f" (e.g. {found.group(1)})" if found else ""
        raise CheckpointError(
            f"{path} holds Python objects outside torch's safe types{what}; rebuilding "
            "them means unpickling, which can run code from the file. If you trust this "
            "checkpoint, pass trust_pickle=True, or allowlist the class with "
            "torch.serialization.add_safe_globals."
        ) from None
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot be read ({type(exc).__name__}: {exc})") from None


def _optimizer_skeleton(
    plan: GatherPlan, groups: list[list[O.ParamRef]], saved: _SavedOptimizer
) -> tuple[O.Skeleton, dict[str, StoredTensor]]:
    """The optimizer state of a checkpoint, checked against the optimizer (groups, and
    every element-wise state shaped like its parameter): its skeleton (param groups,
    scalars, element dtypes: what rank 0 hands ranks that cannot see the directory)
    and where its tensors are stored."""
    O.check_groups(groups, saved.param_groups)
    tensors = stored_tensors(saved.path)
    elements: dict[str, dict[str, torch.dtype]] = {}
    for key, names in saved.elements.items():
        e = plan.entries.get(key)
        if e is None:
            raise StateDictMismatchError(
                f"the checkpoint holds optimizer state for {key!r}, which the model lacks",
                unexpected_keys=[key],
            )
        for name in names:
            t = tensors[f"{name}/{key}"]
            if tuple(t.shape) != tuple(e.shape):
                raise StateDictMismatchError(
                    f"optimizer state {name!r} of {key!r}: {t.dtype} {tuple(t.shape)} in the "
                    f"checkpoint, the parameter is {tuple(e.shape)}",
                    mismatched={key: f"{name}: shape {tuple(t.shape)}"},
                )
            elements.setdefault(key, {})[name] = t.dtype
    return (saved.param_groups, saved.scalars, elements), tensors


@dataclass
class _Opened:
    """What a rank that sees the directory read and validated; rank 0's, posted in the
    plan round, serves the ranks that cannot see it, and ``extra`` (only rank 0 reads
    it) every rank."""

    shapes: L.Shapes
    skeleton: O.Skeleton | None
    extra: Any


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    trust_pickle: bool = False,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    transport: str = "auto",
    progress: bool = False,
) -> dict[str, Any]:
    """Load a directory written by :func:`save_checkpoint` into ``model`` (and
    ``optimizer``); returns the ``extra`` dict. Works at any world size and FSDP
    flavour, and for a plain model in one process with no process group.

    Every rank that sees the directory reads only its own elements; where some rank
    cannot see it (a checkpoint on rank 0's local disk), rank 0 reads it and sends each
    rank just its own elements, one tensor at a time, and hands it the validated
    metadata and ``extra``.

    Every file is validated first — headers, optimizer metadata, the match with the
    model and the optimizer, ``extra`` — so a bad file raises on every rank before
    anything changes. Nothing is unpickled: ``extra.pt`` is read with
    ``weights_only=True``.

    Args:
        trust_pickle: read ``extra.pt`` (and a pre-0.2 ``optim.pt``) with full
            unpickling, for ``extra`` holding arbitrary objects. Only for checkpoints
            you trust: unpickling runs code.
        transport: ``"auto"``: every rank reads its own elements where every rank sees
            the directory, else rank 0 sends them; ``"node-local"`` requires the
            former; ``"collective"`` always has rank 0 read and send.
        progress: one tqdm bar on rank 0 (model and optimizer state), every rank's bytes.

    Raises:
        CheckpointError: not a checkpoint directory (on rank 0), a file is missing or
            corrupt, or ``extra`` needs ``trust_pickle=True``.
        StateDictMismatchError: the model or optimizer does not match.
    """
    with Call("load_checkpoint", timeout) as call:
        opts = Options(timeout=timeout, transport=transport, strict=strict, progress=progress)
        root = os.fspath(path)
        model_file = os.path.join(root, MODEL_FILE)
        reshard_for_load(check_model(model))
        plan = build_plan(model)
        groups = None
        if optimizer is not None:
            groups = O.optimizer_refs(optimizer, O.param_refs(model, plan))
        sees = call.rank == 0 or (opts.transport != "collective" and os.path.isdir(root))
        model_source = state_source = opened = None
        if sees:
            if not os.path.isfile(model_file):
                raise CheckpointError(
                    f"{root}: not a shardgather checkpoint ({MODEL_FILE} missing)"
                )
            tensors = stored_tensors(model_file)
            shapes = {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()}
            subset = read_header(model_file).metadata.get(SUBSET) == "1"
            L.validate(plan, shapes, opts.strict, model_file, partial=subset)
            model_source = L.StoredSource(tensors, model_file)
            skeleton = None
            if groups is not None:
                saved = _read_optimizer(root, trust_pickle)
                O.check_kind(optimizer, saved.param_groups)
                skeleton, stored = _optimizer_skeleton(plan, groups, saved)
                state_source = L.StoredSource(stored, saved.path)
            extra: Any = None  # rank 0 reads it for everyone: it travels in the round
            extra_file = os.path.join(root, EXTRA_FILE)
            if call.rank == 0:
                extra = _torch_load(extra_file, trust_pickle) if os.path.isfile(extra_file) else {}
            opened = _Opened(shapes, skeleton, extra)
        loaded: list[O.LoadedState] = []

        def build(opened: _Opened) -> list[L.Loading]:
            loadings = [L.Loading(plan, model_source)]
            loadings[0].take(opened.shapes)
            if groups is not None:
                assert opened.skeleton is not None
                param_groups, scalars, elements = opened.skeleton
                load_plan, rows = O.load_state_plan(plan, groups, elements)
                state = L.Loading(load_plan, state_source)
                state.take(O.element_shapes(plan, elements))
                loadings.append(state)
                loaded.append(O.LoadedState(rows, scalars, elements, param_groups))
            return loadings

        # Every rank validated what it sees (and rank 0, what it will send): all go on,
        # or all raise, before any change. The optimizer's groups must agree too: a rank
        # checking rank 0's skeleton after this round would be too late.
        view = L.run(
            call,
            plan,
            opts,
            seen=opened,
            build=build,
            sources=[model_source, state_source],
            also_same=O.groups_fingerprint(groups) if groups is not None else "",
        )
        if optimizer is not None:
            assert groups is not None
            optimizer.load_state_dict(O.optimizer_state_dict(groups, loaded[0]))
    return view.extra


def checkpoint_from_zero(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    workers: int | None = None,
    progress: bool = False,
) -> str:
    """A DeepSpeed ZeRO-1/2/3 checkpoint -> a :func:`save_checkpoint` directory: the
    model (fp32 masters, frozen parameters, buffers, ties once; ``dtype`` casts float
    tensors), the optimizer's element-wise states (Adam's moments) by parameter name,
    its param groups and step — so :func:`load_checkpoint` resumes the run exactly in
    an FSDP (or plain) model at any world size. DeepSpeed's own converter keeps the
    weights only. Nothing is unpickled; the copies run on ``workers`` threads; the
    directory appears atomically. Returns its path.

    Raises:
        CheckpointError: not a ZeRO checkpoint, damaged, or holding no optimizer state
            (saved before the first step, or its steps disagree across groups).
    """
    from .io.consolidate import copy_tensors
    from .io.deepspeed_format import read_zero_checkpoint
    from .io.file_set import lay_out, write_alone

    ck = read_zero_checkpoint(src)
    if not ck.states or ck.step is None:
        raise CheckpointError(
            f"{ck.directory}: no element-wise optimizer state to convert (saved before the "
            "first step?); convert the weights alone with `shardgather consolidate`"
        )
    if len(ck.param_groups) != len(ck.groups):
        raise CheckpointError(
            f"{ck.directory}: {len(ck.param_groups)} optimizer param groups for "
            f"{len(ck.groups)} groups of parameters"
        )
    final = os.path.abspath(os.fspath(out))
    tmp = os.path.join(
        os.path.dirname(final), f".{os.path.basename(final)}.tmp-{uuid.uuid4().hex[:8]}"
    )
    model_items = [
        (k, t, dtype if dtype is not None and t.dtype.is_floating_point else t.dtype)
        for k, t in ck.tensors.items()
    ]
    state_items = [
        (f"{name}/{k}", t, t.dtype)
        for name in sorted(ck.states)
        for k, t in ck.states[name].items()
    ]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        total = sum(t.numel * d.itemsize for _, t, d in model_items + state_items)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="checkpoint from ZeRO")
    os.makedirs(tmp)
    try:
        for name, items, aliases in (
            (MODEL_FILE, model_items, ck.aliases),
            (OPTIM_FILE, state_items, {}),
        ):
            fs = lay_out(
                [(k, d, t.shape) for k, t, d in items],
                os.path.join(tmp, name),
                metadata={"source": f"deepspeed ZeRO-{ck.stage} (world {ck.world})"},
                aliases=aliases,
            )
            write_alone(
                fs, lambda fds, where, items=items: copy_tensors(items, fds, where, workers, bar)
            )
        groups = [dict(pg, params=list(names)) for pg, names in zip(ck.param_groups, ck.groups)]
        step = ck.step
        meta = {
            "param_groups": groups,
            "scalars": {k: {"step": step} for k in ck.trainable},
            "elements": {k: sorted(ck.states) for k in ck.trainable},
        }
        _write_durably(os.path.join(tmp, OPTIM_META), json_values.dumps(meta, "optimizer state"))
        buf = io.BytesIO()
        torch.save({"deepspeed": {"directory": ck.directory, "zero_stage": ck.stage}}, buf)
        _write_durably(os.path.join(tmp, EXTRA_FILE), buf.getvalue())
        publish_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    return final
