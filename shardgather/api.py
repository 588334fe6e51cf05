"""The public verbs on state dicts: gather, save, load — model and optimizer state.

Each verb validates its options, builds the plan and hands both to the engine
(``_engine.run.gather`` or the load path of ``_engine.load``), all inside one
:class:`~shardgather._dist.Call`: a failure on any rank raises on every rank.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ._dist import Call
from ._engine import load as L
from ._engine import run, snapshot, staging
from ._engine.optim_state import skeleton_of, state_plan
from ._engine.sinks import Files, HostDict, file_set
from ._engine.snapshot import AsyncSave
from ._options import DEFAULT_TIMEOUT, Options, Transport, check_model
from ._plan import GatherPlan, build_plan, reshard_for_load
from ._plan import optim as O
from ._plan.subset import KeySelection, select
from ._progress import Progress
from .errors import CheckpointError, ShardGatherError
from .io.hf_layout import KeyMap, extra_files, map_keys, output_layout
from .io.safetensors_format import read_header
from .io.sources import open_path, renamed_dict

LoadResult = L.LoadResult


def full_state_dict(
    model: nn.Module,
    *,
    rank0_only: bool = True,
    dtype: torch.dtype | None = None,
    keys: KeySelection | None = None,
    merge_adapter: str | None = None,
    bucket_mb: float | None = None,
    pin_memory: bool = False,
    progress: bool = False,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    transport: str = "auto",
) -> dict[str, torch.Tensor]:
    """The full, unwrapped state dict of a (sharded) model, on CPU.

    Call it on every rank. Keys are exactly the plain model's ``state_dict()`` keys
    (no ``_fsdp_wrapped_module.``, ``_flat_param``, ``_checkpoint_wrapped_module.``,
    ``module.``, ``_orig_mod.``); values are the full-precision stored parameters and
    the buffers, bit-identical, in their own dtype unless ``dtype`` asks for a cast.
    Tied parameters appear under every key and share one tensor.

    Args:
        model: FSDP1 (any sharding strategy), FSDP2 (``fully_shard``, 1-D or HSDP),
            or a plain / DDP / ``torch.compile``'d module (no process group needed).
        rank0_only: only global rank 0 gets the dict, the others get ``{}``; with
            HSDP only rank 0's replica gathers. False: every rank gets it.
        dtype: cast floating-point tensors to this dtype (fused into the copy-out).
        keys: only these keys, and nothing else is gathered, moved or staged:
            ``"trainable"`` (parameters with ``requires_grad``, e.g. LoRA adapters on a
            frozen base), a list of names and prefixes (a prefix ends with ``"."``:
            ``["lm_head.", "model.norm.weight"]``; one matching no key is an error), or
            a predicate of the key. None: every key.
        merge_adapter: the PEFT LoRA adapter (e.g. ``"default"``) to merge into the
            base weights, as PEFT's ``merge_and_unload()``: ``W + scaling * (B @ A)``
            computed by each rank for its own elements of ``W`` (in float32, cast after),
            adapter tensors left out, keys the base model's. Bit-exact with PEFT for
            float32 weights; 16-bit weights are merged in float32 and rounded once
            (PEFT also rounds the delta and the sum in 16 bits: the two differ by those
            roundings). LoRA and rsLoRA on ``nn.Linear``; anything else is refused by
            name.
        bucket_mb: gathered MiB per collective; peak extra memory is about two buckets.
            Default: 16 on CPU (gloo; bigger buckets only add page faults and stall the
            pipeline, measured in bench/), 256 on CUDA.
        pin_memory: return pinned tensors (fast later host-to-device copies).
        progress: one tqdm bar on rank 0 counting the bytes every rank moves (ends
            at 100 %).
        timeout: the longest any wait may last: a failed, dead or stuck rank makes
            every rank raise within it, instead of hanging.
        transport: ``"auto"`` (with ``rank0_only`` and without ``pin_memory``): each
            rank on rank 0's host writes its own pieces straight into one shared-memory
            region per dtype that becomes the output (the output tensors are views of
            it, freed with the last one; CUDA shards go through the copy-out kernel
            and a pinned slab per rank, so every GPU uses its own link); ranks on other
            hosts send only their pieces to rank 0. Otherwise bucketed collectives.
            ``"node-local"``: ask for the former (warns once and falls back when
            impossible, e.g. no memfd shareable and /dev/shm too small).
            ``"collective"``: always the latter.

    Returns:
        ``dict[str, Tensor]``: CPU tensors with the plain model's shapes and strides.

    Raises:
        ShardGatherError: bad arguments.
        UnsupportedModelError: tensor-parallel or non-dim-0 sharded parameters.
        CollectiveError: ranks disagree about the model, or a rank failed, died or is
            stuck (named in the message).

    Example:
        >>> sd = shardgather.full_state_dict(fsdp_model)   # on every rank
        >>> if dist.get_rank() == 0:
        ...     plain_model.load_state_dict(sd)
    """
    merge = merge_transform(model, merge_adapter, keys)
    with Call("full_state_dict", timeout) as call:
        opts = Options(
            dtype=dtype,
            bucket_mb=bucket_mb,
            rank0_only=rank0_only,
            pin_memory=pin_memory,
            progress=progress,
            timeout=timeout,
            transport=transport,
        )
        plan = merge(build_plan(check_model(model), dtype=dtype, keys=keys))
        receives = not rank0_only or call.rank == 0
        sink = HostDict(plan, receives=receives, pin_memory=pin_memory)
        outputs = run.gather(call, plan, sink, opts)
    return with_aliases(plan, outputs)


def merge_transform(
    model: nn.Module,
    merge_adapter: str | None,
    keys: KeySelection | None,
) -> Callable[[GatherPlan], GatherPlan]:
    """The plan transform ``merge_adapter=`` asks for, or the identity (no collective:
    the merged plan fetches what it needs in its own phases)."""
    if merge_adapter is None:
        return lambda plan: plan
    if keys is not None:
        raise ShardGatherError("merge_adapter= writes the whole merged model: leave keys= out")
    from .adapters import merging

    return merging(model, merge_adapter)


def release_staging() -> None:
    """Free what shardgather keeps for reuse between calls: pinned slabs (CUDA), and
    the snapshot buffers of ``blocking=False`` saves (each model's own bytes)."""
    staging.release()
    snapshot.release()


def with_aliases(plan: GatherPlan, outputs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Every key of the plan, in order, tied aliases sharing their primary's tensor."""
    if outputs is None:
        return {}
    return {k: outputs[plan.aliases.get(k, k)] for k in plan.keys}


def save_full_state_dict(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    metadata: dict[str, str] | None = None,
    max_shard_size: int | str | None = None,
    files: Mapping[str, Any] | None = None,
    key_map: KeyMap | None = None,
    keys: KeySelection | None = None,
    merge_adapter: str | None = None,
    bucket_mb: float | None = None,
    progress: bool = False,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    transport: str = "auto",
    shared_filesystem: bool = False,
    blocking: bool = True,
    in_flight: str = "wait",
    reuse_staging: bool = True,
    max_snapshot_mb: float | None = None,
    write_mb_per_s: float | None = None,
) -> AsyncSave | None:
    """Write the full, unwrapped state dict to one safetensors file, or to the sharded
    directory Hugging Face's ``save_pretrained`` writes, streaming.

    Call on every rank. No rank ever holds the whole model: peak extra host memory is
    about two buckets. Tied tensors are stored once (as transformers stores them) and
    their aliases recorded in the header metadata (``shardgather.aliases``) of the file
    holding the tensor, which :func:`load_file` and :func:`load_full_state_dict`
    restore. Everything is written under a temporary name beside ``path``, fsync'ed by
    every rank that wrote, and renamed in one step: a failure on any rank leaves
    ``path`` as it was (and no temporary behind), and every rank raises.

    Args:
        model: as for :func:`shardgather.full_state_dict`.
        path: the ``.safetensors`` file to create (replaced if it exists), or a
            directory — a path ending in ``/`` or an existing directory — for the
            Hugging Face layout (files of at most 5GB, as ``save_pretrained``, unless
            ``max_shard_size`` says otherwise). A ``.safetensors`` name with
            ``max_shard_size`` is an error (a directory named like a file).
        dtype: cast floating-point tensors (e.g. ``torch.bfloat16`` to ship a model).
        metadata: extra ``str -> str`` header metadata (in every file).
        max_shard_size: write ``path`` as a Hugging Face directory: files of at most this
            many bytes (``int``, or ``"5GB"`` = 5 * 10**9 as transformers reads it, or
            ``"4GiB"``), split at tensor boundaries in the model's order (a larger
            tensor gets a file of its own), named ``model-00001-of-0000N.safetensors``,
            with ``model.safetensors.index.json`` (``total_size``, ``weight_map``); one
            file is ``model.safetensors`` with no index, as transformers does. An
            existing directory keeps its other files (``config.json``, tokenizer...);
            its ``*.safetensors`` and indexes are replaced.
        files: for a directory, extra files for the directory, by name:
            ``bytes``/``str`` content, a dict (written as JSON, e.g. ``config.to_dict()``)
            or an ``os.PathLike`` to copy. Rank 0's values are written.
        key_map: the names to store under, from the model's: ``{model_prefix:
            file_prefix}`` (longest prefix wins; e.g. ``{"": "model."}``) or a callable
            from a model key to a file key. The same direction as ``load_full_state_dict``'s
            (from where the tensors come to where they go).
        keys: store only these keys (as for :func:`shardgather.full_state_dict`):
            nothing else is moved or written; ``key_map`` then names just these.
        merge_adapter: write the base model with this PEFT LoRA adapter merged in (as
            for :func:`shardgather.full_state_dict`): a ``from_pretrained``-able
            checkpoint of the base architecture (with ``max_shard_size``/``files``).
        bucket_mb, progress, timeout: as for :func:`shardgather.full_state_dict`.
        transport: ``"auto"``: every rank on rank 0's host (the same filesystem)
            pwrites its own pieces into the file(s) in parallel, and ranks on other
            hosts send theirs to rank 0 point to point; ``"collective"``: rank 0 writes
            what bucketed collectives bring it. ``"node-local"`` asks for the former
            (warns once and falls back).
        shared_filesystem: ``path`` is on a filesystem every host mounts (NFS,
            Lustre, GPFS...): ranks on other hosts then pwrite their own pieces into
            the file too, instead of sending them to rank 0.
        blocking: False: return as soon as every rank has copied its own pieces aside
            (one memcpy of its shard, into staging reused from the previous save); a
            thread of each rank writes and fsyncs them while training goes on — the
            optimizer may step at once, the file holds the values at call time. Returns
            an :class:`AsyncSave`: call its ``wait()`` on every rank to agree and
            publish (the next save of the model does it otherwise). Needs the
            node-local transport (one host, or ``shared_filesystem=True``); elsewhere
            the data is written at call time (warned once).
        in_flight: what a save does while an earlier ``blocking=False`` save of the
            same model is still pending: ``"wait"`` finishes it first, ``"error"``
            raises.
        reuse_staging: keep the snapshot buffer (the rank's own bytes) for the next
            save of this model: the next snapshot is then a plain memcpy into memory
            already faulted in (or pinned). ``shardgather.release_staging()`` frees it.
        max_snapshot_mb: at most this much staging; pieces beyond it are written at
            call time (the call blocks for them).
        write_mb_per_s: the background writer's pace per rank (None: the disk's). The
            aligned bulk of the snapshot goes to the disk with O_DIRECT (no copy, next
            to no CPU), but the disk's traffic itself may slow training on a machine
            with no core or I/O to spare; a pace trades time to durability for that.

    Returns:
        None, or (``blocking=False``) the :class:`AsyncSave` handle.

    Raises:
        ShardGatherError: bad arguments; CheckpointError: rank 0 cannot create the
        output; CollectiveError: a rank failed, died or is stuck.

    Example:
        >>> shardgather.save_full_state_dict(model, "model.safetensors", dtype=torch.bfloat16)
        >>> shardgather.save_full_state_dict(            # a from_pretrained-able directory
        ...     model, "out/llama", max_shard_size="5GB", key_map={"": "model."},
        ...     files={"config.json": hf_config.to_dict()})
    """
    opts = Options(
        dtype=dtype,
        bucket_mb=bucket_mb,
        progress=progress,
        timeout=timeout,
        transport=transport,
        shared_filesystem=shared_filesystem,
        in_flight=in_flight,
        max_snapshot_mb=max_snapshot_mb,
        write_mb_per_s=write_mb_per_s,
    )
    if merge_adapter is not None and not blocking:
        raise ShardGatherError("merge_adapter= saves block: pass blocking=True")
    snapshot.settle(model, opts.in_flight)
    merge = merge_transform(model, merge_adapter, keys)
    with Call("save_full_state_dict", timeout) as call:
        plan = merge(build_plan(check_model(model), dtype=dtype, keys=keys))
        options = _file_options(plan, path, metadata, max_shard_size, files, key_map)
        fs = file_set(plan, path, **options)
        sink = Files(fs, what="save_full_state_dict")
        if blocking:
            run.gather(call, plan, sink, opts)
            return None
        keep: list[Any] = []
        buffer = snapshot.buffer_for(model, "model", keep, reuse_staging)
        later = snapshot.gather_later(call, plan, sink, opts, buffer)
        bar = Progress(call, opts.progress, run.plan_bytes(plan), f"shardgather: {call.what}")
    save = AsyncSave(call, [later], owner=id(model), keep=keep, path=path, progress=bar)
    return snapshot.start(model, save)


def _file_options(
    plan: GatherPlan,
    path: str | os.PathLike,
    metadata: dict[str, str] | None,
    max_shard_size: int | str | None,
    files: Mapping[str, Any] | None,
    key_map: KeyMap | None,
) -> dict[str, Any]:
    if metadata is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ShardGatherError("metadata must be a dict of str -> str (safetensors' rule)")
    shard_bytes = output_layout(path, max_shard_size)
    if files and shard_bytes is None:
        raise ShardGatherError(
            "files= are written into a directory: pass a directory path ('export/') or "
            "max_shard_size= (e.g. '5GB') too"
        )
    return {
        "metadata": metadata,
        "stored_names": _stored_names(plan, key_map),
        "max_shard_size": shard_bytes,
        "files": extra_files(files),
    }


def _stored_names(plan: GatherPlan, key_map: KeyMap | None) -> dict[str, str] | None:
    """model key -> key in the file; every key must keep a name."""
    if key_map is None:
        return None
    to_model = map_keys(plan.keys, key_map, into="file's")  # file key -> model key
    if len(to_model) != len(plan.keys):
        dropped = sorted(set(plan.keys) - set(to_model.values()))
        raise ShardGatherError(
            f"key_map drops the model's {dropped[:5]}: it names every key it is given; to "
            "leave keys out, select the others with keys= (e.g. keys='trainable')"
        )
    return {m: f for f, m in to_model.items()}


# ---------------------------------------------------------------------------------- load


def load_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a safetensors file into a dict, restoring tied aliases as shared tensors.

    Example:
        >>> plain_model.load_state_dict(shardgather.load_file("model.safetensors"))
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file as st_load

    header = read_header(path)  # the whole header validated before any data is read
    try:
        sd = st_load(os.fspath(path))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{os.fspath(path)}: cannot be read ({exc})") from None
    for alias, key in header.aliases.items():
        sd[alias] = sd[key]
    return sd


def load_full_state_dict(
    model: nn.Module,
    source: str | os.PathLike | Mapping[str, torch.Tensor],
    *,
    strict: bool = True,
    bucket_mb: float = 64,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    key_map: KeyMap | None = None,
    keys: KeySelection | None = None,
    transport: str = "auto",
    progress: bool = False,
) -> LoadResult:
    """Load a full state dict into a (sharded) model, in place, each rank taking only
    its own elements.

    From safetensors — one file, or a Hugging Face directory of shard files with its
    ``model.safetensors.index.json`` — a DCP directory or a DeepSpeed ZeRO checkpoint,
    every rank preads only the byte ranges of its own shards (plus the small tensors
    every rank holds in full, such as buffers) and the copy-in op writes them (cast
    where the source holds another float dtype) into its shard storage; a torch file is
    memory-mapped, so only the pages of a rank's own elements are read; a dict is used
    where it is. When only rank 0 holds the source (a dict, ``{}`` elsewhere, or a file
    on rank 0's own disk), rank 0 sends each rank just its own elements of each tensor,
    one tensor at a time. No all-gather. Keys and shapes are validated on every rank
    first: on a mismatch nothing is modified.

    Args:
        model: plain, DDP, FSDP1 or FSDP2 model (the same kinds as full_state_dict).
        source: a ``.safetensors`` path (e.g. from :func:`save_full_state_dict`), a
            directory ``save_pretrained`` wrote (sharded or not) or its index file, a
            ``torch.distributed.checkpoint`` directory, a DeepSpeed ZeRO-1/2/3
            checkpoint (its ``global_stepN`` directory, or the parent naming it in
            ``latest``: the fp32 master weights, frozen parameters and buffers, read
            without unpickling), a ``torch.save`` file
            (``.pt``/``.bin``; a nested ``state_dict``/``model`` dict is found; wrapped
            key names are cleaned), or a dict of full tensors.
        strict: raise on missing/unexpected keys; False loads the intersection.
        bucket_mb: staging buffer size for file reads that cast.
        timeout: as for :func:`shardgather.full_state_dict`.
        key_map: the source's names -> the model's, applied before validation:
            ``{source_prefix: model_prefix}`` (e.g. ``{"model.": ""}`` to load a causal
            LM's file into its inner model) or a callable (None drops a key).
        keys: load only these of the model's keys (as for
            :func:`shardgather.full_state_dict`; e.g. an adapter file into a model with a
            frozen base): the source's other keys are left alone, not unexpected, and
            ``strict`` asks that every selected key is in the source.
        transport: ``"auto"``: every rank reads its own elements where it can see the
            source, else rank 0 sends them; ``"node-local"`` requires the former;
            ``"collective"`` always has rank 0 send.
        progress: one tqdm bar on rank 0 counting every rank's bytes.

    Returns:
        ``LoadResult(missing_keys, unexpected_keys)`` (clean names).

    Raises:
        CheckpointError: missing, truncated, corrupt or unsupported file.
        StateDictMismatchError: keys (strict), shapes or non-castable dtypes differ.
    """
    with Call("load_full_state_dict", timeout) as call:
        opts = Options(
            bucket_mb=bucket_mb,
            timeout=timeout,
            transport=transport,
            strict=strict,
            progress=progress,
        )
        if not isinstance(source, (str, os.PathLike, Mapping)):
            raise ShardGatherError(
                f"source must be a file path or a dict of tensors, got {type(source).__name__}"
            )
        reshard_for_load(check_model(model))  # else a forward after an evaluation ignores it
        whole = build_plan(model)
        plan = select(whole, keys)
        others = set(whole.keys) - set(plan.keys)
        what, src, renamed = _open_source(call, source, key_map)
        seen = None  # the shapes this rank validated (rank 0's serve the ranks without)
        if src is not None and src.has:
            seen = src.shapes()
            L.validate(plan, seen, opts.strict, what, renamed, others)
            if opts.transport != Transport.COLLECTIVE:
                feeds = L.Loading(plan, src)
                feeds.take(seen)
                try:
                    src.locate_own(plan, feeds.keys)
                except CheckpointError as exc:
                    raise CheckpointError(
                        f"load_full_state_dict({what!r}): nothing was loaded: {exc}"
                    ) from None
        result: list[L.LoadResult] = []

        def build(shapes: L.Shapes) -> list[L.Loading]:
            result.append(L.validate(plan, shapes, opts.strict, what, renamed, others))
            loading = L.Loading(plan, src if seen is not None else None)
            loading.take(shapes)
            return [loading]

        L.run(call, plan, opts, seen=seen, build=build, sources=[src])
    return result[0]


def _open_source(
    call: Call, source: str | os.PathLike | Mapping[str, torch.Tensor], key_map: KeyMap | None
) -> tuple[str, L.Source | None, dict[str, str]]:
    """(what to call it in errors, this rank's view of it or None, renames made)."""
    if isinstance(source, Mapping):
        return "the state dict", L.DictSource(renamed_dict(source, key_map)), {}
    path = os.fspath(source)
    if call.rank != 0 and not os.path.exists(path):
        return path, None, {}  # rank 0 sends this rank its elements
    tensors, renamed = open_path(path, key_map)
    first = next(iter(tensors.values()), None)
    if first is None or isinstance(first, torch.Tensor):
        return path, L.DictSource(tensors), renamed  # type: ignore[arg-type]
    return path, L.StoredSource(tensors, path), renamed  # type: ignore[arg-type]


# ------------------------------------------------------------------------ optimizer state


def full_optim_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    rank0_only: bool = True,
    bucket_mb: float | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    transport: str = "auto",
    progress: bool = False,
) -> dict[str, Any]:
    """The full optimizer state, keyed by the plain model's parameter names.

    Call on every rank. State tensors (``exp_avg``, ``momentum_buffer``...) are
    gathered like their parameters (same plan, buckets and kernels); scalars such as
    ``step`` are taken as they are. FSDP1 flat parameters are split back into the
    original parameters.

    Args:
        model, optimizer: the (sharded) model and the optimizer built on its parameters.
        rank0_only: only global rank 0 gets the dict (others ``{}``).
        bucket_mb, timeout, transport, progress: as for
            :func:`shardgather.full_state_dict`.

    Returns:
        ``{"state": {name: {state: value}}, "param_groups": [{..., "params": [name]}]}``.

    Example:
        >>> osd = shardgather.full_optim_state_dict(model, optimizer)
    """
    with Call("full_optim_state_dict", timeout) as call:
        opts = Options(
            bucket_mb=bucket_mb,
            rank0_only=rank0_only,
            timeout=timeout,
            transport=transport,
            progress=progress,
        )
        st = state_plan(call, check_model(model), optimizer)
        receives = not rank0_only or call.rank == 0
        gathered = run.gather(call, st.plan, HostDict(st.plan, receives=receives), opts)
    return st.assemble(gathered) if gathered is not None else {}


def load_full_optim_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    osd: dict[str, Any],
    *,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    transport: str = "auto",
    progress: bool = False,
) -> None:
    """Load a full optimizer state (from :func:`full_optim_state_dict`, any world size
    or FSDP flavour) into ``optimizer``: each rank keeps only its shard of every state
    tensor. ``osd`` on every rank, or on rank 0 only (``{}`` elsewhere): then rank 0
    sends every rank just its own elements of each state tensor, one tensor at a time,
    in an order every rank knows up front (scalars and groups travel with the plan
    round). The optimizer changes only once every rank has its state.

    Raises:
        StateDictMismatchError: the param groups or parameter names do not match;
            nothing is loaded.
    """
    with Call("load_full_optim_state_dict", timeout) as call:
        opts = Options(timeout=timeout, transport=transport, progress=progress)
        plan = build_plan(check_model(model))
        groups = O.optimizer_refs(optimizer, O.param_refs(model, plan))
        skeleton, source = None, None
        if osd:
            O.check_kind(optimizer, osd.get("param_groups") if isinstance(osd, dict) else None)
            skeleton, tensors = skeleton_of(plan, groups, osd)
            source = L.DictSource(tensors)
        loaded: list[O.LoadedState] = []

        def build(skeleton: O.Skeleton) -> list[L.Loading]:
            param_groups, scalars, elements = skeleton
            load_plan, rows = O.load_state_plan(plan, groups, elements)
            loaded.append(O.LoadedState(rows, scalars, elements, param_groups))
            state = L.Loading(load_plan, source)
            state.take(O.element_shapes(plan, elements))
            return [state]

        # A rank without osd checks its groups only through the plan round (too late after).
        L.run(
            call,
            plan,
            opts,
            seen=skeleton,
            build=build,
            also_same=O.groups_fingerprint(groups),
        )
        optimizer.load_state_dict(O.optimizer_state_dict(groups, loaded[0]))
