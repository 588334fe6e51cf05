"""save_full_state_dict / load_full_state_dict / load_file: full safetensors
checkpoints streamed bucket by bucket; loading reads only each rank's own bytes."""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from . import _layout as L
from . import _ops
from ._collectives import agree, p2p_device, scatter_slice
from ._options import DEFAULT_TIMEOUT, verify_options, verify_transport
from ._plan import (
    Entry,
    GatherPlan,
    build_plan,
    elems_in_row,
    flat_of,
    memory_order_flat,
    own_range,
    reshard_for_load,
)
from ._save import file_set, save_plan
from .api import all_ok
from .errors import CheckpointError, ShardGatherError, StateDictMismatchError
from .io.dcp_format import dcp_sources, is_dcp_directory
from .io.hf_layout import (
    KeyMap,
    extra_files,
    is_safetensors_source,
    map_keys,
    open_sources,
    parse_size,
    safetensors_files,
)
from .io.safetensors_format import (
    pread_into,
    read_header,
)
from .io.stored import StoredTensor, one_extent


def save_full_state_dict(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    metadata: dict[str, str] | None = None,
    max_shard_size: int | str | None = None,
    files: Mapping[str, Any] | None = None,
    key_map: KeyMap | None = None,
    bucket_mb: float | None = None,
    progress: bool = False,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    transport: str = "auto",
    shared_filesystem: bool = False,
) -> None:
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
        path: the ``.safetensors`` file to create (replaced if it exists) or, with
            ``max_shard_size``, the directory.
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
        files: with ``max_shard_size``, extra files for the directory, by name:
            ``bytes``/``str`` content, a dict (written as JSON, e.g. ``config.to_dict()``)
            or an ``os.PathLike`` to copy. Rank 0's values are written.
        key_map: the names to store under, from the model's: ``{model_prefix:
            file_prefix}`` (longest prefix wins; e.g. ``{"": "model."}``) or a callable
            from a model key to a file key. The same direction as ``load_full_state_dict``'s
            (from where the tensors come to where they go).
        bucket_mb, progress, timeout: as for :func:`shardgather.full_state_dict`.
        transport: ``"auto"``: every rank on rank 0's host (the same filesystem)
            pwrites its own pieces into the file(s) in parallel, and ranks on other
            hosts send theirs to rank 0 point to point; ``"collective"``: rank 0 writes
            what bucketed collectives bring it. ``"node-local"`` asks for the former (warns once
            and falls back).
        shared_filesystem: ``path`` is on a filesystem every host mounts (NFS,
            Lustre, GPFS...): ranks on other hosts then pwrite their own pieces into
            the file too, instead of sending them to rank 0.

    Raises:
        ShardGatherError: bad arguments; CollectiveError: another rank failed.

    Example:
        >>> shardgather.save_full_state_dict(model, "model.safetensors", dtype=torch.bfloat16)
        >>> shardgather.save_full_state_dict(            # a from_pretrained-able directory
        ...     model, "out/llama", max_shard_size="5GB", key_map={"": "model."},
        ...     files={"config.json": hf_config.to_dict()})
    """
    verify_options(model, bucket_mb, dtype)
    verify_transport(transport, False)
    if metadata is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ShardGatherError("metadata must be a dict of str -> str (safetensors' rule)")
    shard_bytes = parse_size(max_shard_size) if max_shard_size is not None else None
    if files and shard_bytes is None:
        raise ShardGatherError(
            "files= are written into a directory: pass max_shard_size= (e.g. '5GB') too"
        )
    extra = extra_files(files)
    plan = build_plan(model, dtype=dtype)
    stored = _stored_names(plan, key_map)
    agree(plan, timeout)
    fs = file_set(
        plan,
        path,
        metadata=metadata,
        stored_names=stored,
        max_shard_size=shard_bytes,
        files=extra,
    )
    save_plan(
        plan,
        fs,
        bucket_mb=bucket_mb,
        progress=progress,
        timeout=timeout,
        transport=transport,
        shared_filesystem=shared_filesystem,
    )


def _stored_names(plan: GatherPlan, key_map: KeyMap | None) -> dict[str, str] | None:
    """model key -> key in the file; every key must keep a name."""
    if key_map is None:
        return None
    to_model = map_keys(plan.keys, key_map, into="file's")  # file key -> model key
    if len(to_model) != len(plan.keys):
        dropped = sorted(set(plan.keys) - set(to_model.values()))
        raise ShardGatherError(
            f"key_map drops the model's {dropped[:5]}: a saved checkpoint stores every key "
            "(to leave tensors out, save a plain state dict with safetensors)"
        )
    return {m: f for f, m in to_model.items()}


# ---------------------------------------------------------------------------------- load


class LoadResult(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


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


def _source_key(plan: GatherPlan, key: str, available: Mapping[str, Any]) -> str | None:
    """The key a source holds an entry under: its own, or a tied alias's."""
    if key in available:
        return key
    return next((a for a, p in plan.aliases.items() if p == key and a in available), None)


def _validate(
    plan: GatherPlan,
    available: dict[str, tuple[tuple[int, ...], torch.dtype]],
    strict: bool,
    what: str,
    renamed: dict[str, str] | None = None,
) -> LoadResult:
    """Compare the source's keys/shapes/dtypes with the model before touching anything.
    A tied alias counts as present when its primary is (and vice versa). ``renamed``:
    model key -> the source's own name, where a key map changed it (errors say both)."""
    renamed = renamed or {}

    def named(k: str) -> str:
        return f"{k} (source key {renamed[k]!r})" if k in renamed else k

    have = set(available)
    for alias, primary in plan.aliases.items():
        if alias in have:
            have.add(primary)
        if primary in have:
            have.add(alias)
    missing = [k for k in plan.keys if k not in have]
    unexpected = sorted(set(available) - set(plan.keys))
    mismatched: dict[str, str] = {}
    for key, e in plan.entries.items():
        src_key = _source_key(plan, key, available)
        if src_key is None:
            continue
        shape, dtype = available[src_key]
        if tuple(shape) != tuple(e.shape):
            mismatched[key] = f"shape {tuple(shape)} in source, {tuple(e.shape)} in model"
        elif dtype != e.dtype and not (_castable(dtype) and _castable(e.dtype)):
            mismatched[key] = f"dtype {dtype} in source, {e.dtype} in model (cannot cast)"
    if mismatched or (strict and (missing or unexpected)):
        parts = []
        if missing:
            parts.append(f"missing keys {missing}")
        if unexpected:
            parts.append(f"unexpected keys {[named(k) for k in unexpected]}")
        if mismatched:
            parts.append(
                "mismatched " + "; ".join(f"{named(k)}: {v}" for k, v in mismatched.items())
            )
        raise StateDictMismatchError(
            f"{what} does not match the model: " + ", ".join(parts) + ". Nothing was loaded. "
            "Pass strict=False to load only the matching keys.",
            missing,
            unexpected,
            mismatched,
        )
    return LoadResult(missing, unexpected)


def _castable(dtype: torch.dtype) -> bool:
    """The copy kernels cast between fp16, bf16, fp32 and fp64; any other dtype (e.g.
    float8) is copied as raw bytes, so it must match exactly."""
    return dtype in L.KIND_DTYPE.values()


def _local_row(e: Entry) -> tuple[torch.Tensor, int]:
    """The storage this rank's elements of ``e`` are written to: (uint8 [1, row_bytes], row)."""
    src = e.source
    if src.storage is None:
        raise ShardGatherError(f"{e.key!r}: its tensor is not dense; it cannot be loaded in place")
    t = src.storage()
    return t.view(torch.uint8).view(1, -1) if t.element_size() > 1 else t.view(1, -1), src.rank


def load_full_state_dict(
    model: nn.Module,
    source: str | os.PathLike | Mapping[str, torch.Tensor],
    *,
    strict: bool = True,
    bucket_mb: float = 64,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    key_map: KeyMap | None = None,
) -> LoadResult:
    """Load a full state dict into a (sharded) model, in place, each rank taking only
    its own elements.

    From safetensors — one file, or a Hugging Face directory of shard files with its
    ``model.safetensors.index.json`` — every rank preads only the byte ranges of its own shards
    (plus the small tensors every rank holds in full, such as buffers) through a
    bounded staging buffer; a torch file is memory-mapped, so only the pages of a
    rank's own elements are read; a dict is used where it is, or — when only rank 0
    has it (``{}`` elsewhere) — rank 0 sends each rank just its own elements of each
    tensor, one tensor at a time. The copy-in op writes the
    elements (cast where the source holds another float dtype) into the local shard
    storage. No all-gather. Keys and shapes are validated first: on a mismatch nothing
    is modified.

    Args:
        model: plain, DDP, FSDP1 or FSDP2 model (the same kinds as full_state_dict).
        source: a ``.safetensors`` path (e.g. from :func:`save_full_state_dict`), a
            directory ``save_pretrained`` wrote (sharded or not) or its index file, a
            ``torch.save`` file (``.pt``/``.bin``; a nested ``state_dict``/``model`` dict
            is found; wrapped key names are cleaned), or a dict of full tensors.
        strict: raise on missing/unexpected keys; False loads the intersection.
        bucket_mb: staging buffer size for file reads.
        key_map: the source's names -> the model's, applied before validation:
            ``{source_prefix: model_prefix}`` (e.g. ``{"model.": ""}`` to load a causal
            LM's file into its inner model) or a callable (None drops a key).

    Returns:
        ``LoadResult(missing_keys, unexpected_keys)`` (clean names).

    Raises:
        CheckpointError: missing, truncated, corrupt or unsupported file.
        StateDictMismatchError: keys (strict), shapes or non-castable dtypes differ.
    """
    verify_options(model, bucket_mb, None)
    if not isinstance(source, (str, os.PathLike, Mapping)):
        raise ShardGatherError(
            f"source must be a file path or a dict of tensors, got {type(source).__name__}"
        )
    reshard_for_load(model)  # else a forward after an evaluation would ignore the load
    plan = build_plan(model)
    agree(plan, timeout)
    if isinstance(source, Mapping):
        return _load_from_dict(
            plan, _renamed(dict(source), key_map), strict, "the state dict", timeout
        )
    path = os.fspath(source)
    dcp = is_dcp_directory(path)
    if not (dcp or is_safetensors_source(path) or _looks_like_safetensors(path)):
        return _load_from_dict(
            plan, _renamed(read_torch_file(path), key_map), strict, path, timeout
        )
    # Every header, index or DCP metadata validated, and the keys matched, before any
    # data moves.
    stored = dcp_sources(path) if dcp else stored_tensors(path)
    names = map_keys(stored, key_map)
    sources = {model_key: stored[src_key] for model_key, src_key in names.items()}
    shapes = {k: (t.shape, t.dtype) for k, t in sources.items()}
    renamed = {k: v for k, v in names.items() if k != v}
    result = _validate(plan, shapes, strict, path, renamed)
    if dcp:
        # A DCP chunk's bytes are located from its own small zip directory: every rank
        # reads those of its chunks first and the ranks agree, so that a damaged chunk
        # is refused before any shard changes.
        error = ""
        try:
            _locate_own(plan, sources)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        failures = all_ok(not error, error)
        if failures:
            raise CheckpointError(
                f"load_full_state_dict({path!r}): nothing was loaded: " + "; ".join(failures)
            )
    error = ""
    try:
        _read_own_bytes(plan, sources, int(bucket_mb * 2**20))
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    failures = all_ok(not error, error)
    if failures:
        raise CheckpointError(f"load_full_state_dict({path!r}) failed: " + "; ".join(failures))
    return result


def stored_tensors(path: str) -> dict[str, StoredTensor]:
    """Every key (and tied alias) of a safetensors file, directory or index -> where
    its bytes are."""
    return {
        key: one_extent(key, f, info.dtype, tuple(info.shape), info.begin)
        for key, (f, info) in open_sources(*safetensors_files(path)).items()
    }


def _looks_like_safetensors(path: str) -> bool:
    if path.endswith(".safetensors"):
        return True
    if path.endswith((".pt", ".pth", ".bin", ".ckpt")):
        return False
    try:
        read_header(path)
        return True
    except CheckpointError:
        return False


def read_torch_file(path: str, clean: bool = True) -> dict[str, torch.Tensor]:
    """A torch.save'd state dict, memory-mapped: only the pages a rank reads are loaded.
    A nested ``state_dict``/``model``/``module`` dict is found; ``clean`` strips wrapper
    prefixes from the keys."""
    from ._fqn import clean_fqn

    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such file")
    try:
        obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: not a safetensors or torch checkpoint ({exc})") from exc
    for nested in ("state_dict", "model", "module"):
        if isinstance(obj, dict) and isinstance(obj.get(nested), dict):
            obj = obj[nested]
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a dict of tensors, got {type(obj).__name__}")
    return {
        (clean_fqn(k) if clean else k): v for k, v in obj.items() if isinstance(v, torch.Tensor)
    }


def _renamed(sd: dict[str, torch.Tensor], key_map: KeyMap | None) -> dict[str, torch.Tensor]:
    if key_map is None:
        return sd
    return {model_key: sd[src_key] for model_key, src_key in map_keys(sd, key_map).items()}


def _load_from_dict(
    plan: GatherPlan,
    sd: dict[str, torch.Tensor],
    strict: bool,
    what: str,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> LoadResult:
    """Every rank holds the dict, or rank 0 alone: then rank 0 sends every rank just its
    own elements of each tensor, point to point (one tensor in flight)."""
    everyone_has = True
    if dist.is_initialized() and dist.get_world_size() > 1:
        flags: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(flags, bool(sd))
        everyone_has = all(flags)
        if not everyone_has and not flags[0]:
            raise ShardGatherError("load_full_state_dict: rank 0 has no state dict to load")
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in sd.items()}
    if not everyone_has:
        box = [shapes if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        shapes = box[0]
    result = _validate(plan, shapes, strict, what)
    error = ""
    try:
        if everyone_has:
            for key, e in plan.entries.items():
                src_key = _source_key(plan, key, shapes)
                if src_key is not None:
                    _copy_in_entry(e, sd[src_key])
        else:
            error = _scatter_from_rank0(plan, sd, shapes, timeout)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    failures = all_ok(not error, error)
    if failures:
        raise CheckpointError(f"load_full_state_dict({what}) failed: " + "; ".join(failures))
    return result


def _scatter_from_rank0(
    plan: GatherPlan,
    sd: dict[str, torch.Tensor],
    shapes: dict[str, tuple],
    timeout: datetime.timedelta,
) -> str:
    """Rank 0 sends each rank its own elements of every tensor (all of a tensor every
    rank holds in full); everyone copies them in. Returns "" or what failed here; after
    a failure the exchange still runs its course so that nobody hangs."""
    loaded = {key: _source_key(plan, key, shapes) for key in plan.entries}
    mine = {key: own_range(e) for key, e in plan.entries.items() if loaded[key] is not None}
    ranges: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranges, mine)
    device = p2p_device()
    error = ""

    def copy_in(e: Entry, flat: torch.Tensor) -> None:
        nonlocal error
        if not error:
            try:
                _copy_in_slice(e, *mine[e.key], flat)
            except Exception as exc:
                error = f"{e.key}: {type(exc).__name__}: {exc}"

    for key, e in plan.entries.items():
        src_key = loaded[key]
        if src_key is None:
            continue
        flat = None
        if dist.get_rank() == 0:
            try:
                flat = flat_of(e, sd[src_key]).to(device)
            except Exception as exc:
                error = error or f"{key}: {type(exc).__name__}: {exc}"
        scatter_slice(
            flat,
            [r.get(key) for r in ranges],
            shapes[src_key][1],
            timeout,
            key,
            lambda t, e=e: copy_in(e, t),
        )
    return error


def _copy_in_entry(e: Entry, full: torch.Tensor) -> None:
    """This rank's elements of one entry, from a full tensor, into its shard storage."""
    lo, hi = own_range(e)
    if hi > lo:
        _copy_in_slice(e, lo, hi, flat_of(e, full)[lo:hi])


def _copy_in_slice(e: Entry, lo: int, hi: int, flat: torch.Tensor) -> None:
    """Elements ``lo:hi`` (memory order) of ``e``, given as ``flat``, into this rank's
    shard storage (cast to its dtype)."""
    row, first_row = _local_row(e)
    src = e.source
    if row.is_cuda:
        flat = flat.to(row.device)
    elif flat.device.type != "cpu":
        flat = flat.cpu()
    seg = L.Segment(
        e.base + lo, src.row_numel, 0, hi - lo, 0, 0, L.kind_of(src.dtype), L.kind_of(flat.dtype)
    )
    _ops.copy_in([flat], L.segment_table([seg]), row, first_row)


def _locate_own(plan: GatherPlan, sources: Mapping[str, StoredTensor]) -> None:
    """Where this rank's elements of every entry are (reads DCP chunks' directories)."""
    for key, e in plan.entries.items():
        src_key = _source_key(plan, key, sources)
        if src_key is not None:
            stored = sources[src_key]
            if not e.is_contiguous:
                lo, hi = 0, stored.numel
            else:
                lo, hi = elems_in_row(e.base, e.source.row_numel, e.numel, _local_row(e)[1])
            for _ in stored.runs(lo, hi):
                pass


def _read_own_bytes(
    plan: GatherPlan, sources: Mapping[str, StoredTensor], staging_bytes: int
) -> None:
    """pread exactly this rank's elements of every entry (from whichever files hold
    them: a model key's tensor may span several, one per DCP chunk) and copy them into
    its shards, through one staging buffer of at most ``staging_bytes``."""
    staging = torch.empty(0, dtype=torch.uint8)
    fds: dict[str, int] = {}

    def fd_of(path: str) -> int:
        if path not in fds:
            fds[path] = os.open(path, os.O_RDONLY)
        return fds[path]

    try:
        for key, e in plan.entries.items():
            src_key = _source_key(plan, key, sources)
            if src_key is None:
                continue
            stored = sources[src_key]
            row, first_row = _local_row(e)
            src = e.source
            if not e.is_contiguous:
                _load_strided(fd_of, e, stored, row, first_row)
                continue
            lo, hi = elems_in_row(e.base, src.row_numel, e.numel, first_row)
            fsize = stored.dtype.itemsize
            if stored.dtype == src.dtype and not row.is_cuda:
                # Same dtype, host shard: the file's bytes are the shard's bytes, so
                # pread them straight into place (no staging, no second copy).
                start = (e.base + lo - first_row * src.row_numel) * fsize
                for path, offset, first, count in stored.runs(lo, hi):
                    at = start + (first - lo) * fsize
                    pread_into(fd_of(path), row[0, at : at + count * fsize], offset)
                continue
            step = max(1, staging_bytes // fsize)
            for a in range(lo, hi, step):
                b = min(hi, a + step)
                n = (b - a) * fsize
                if staging.numel() < n:
                    # CUDA shards read pinned staging through its mapped address.
                    staging = torch.empty(n, dtype=torch.uint8, pin_memory=row.is_cuda)
                buf = staging[:n]
                for path, offset, first, count in stored.runs(a, b):
                    at = (first - a) * fsize
                    pread_into(fd_of(path), buf[at : at + count * fsize], offset)
                seg = L.Segment(
                    e.base + a,
                    src.row_numel,
                    0,
                    b - a,
                    0,
                    0,
                    L.kind_of(src.dtype),
                    L.kind_of(stored.dtype),
                )
                _ops.copy_in([buf], L.segment_table([seg]), row, first_row)
                if row.is_cuda:
                    torch.cuda.current_stream(row.device).synchronize()  # the kernel's stream
    finally:
        for fd in fds.values():
            os.close(fd)


def _load_strided(
    fd_of: Any, e: Entry, stored: StoredTensor, row: torch.Tensor, first_row: int
) -> None:
    """A non-contiguous (e.g. channels_last) entry: the file is row-major, the shard
    holds memory order, so read it whole and re-lay it out first."""
    size = stored.dtype.itemsize
    raw = torch.empty(stored.numel * size, dtype=torch.uint8)
    for path, offset, first, count in stored.runs(0, stored.numel):
        pread_into(fd_of(path), raw[first * size : (first + count) * size], offset)
    full = raw.view(stored.dtype).view(stored.shape)
    laid = torch.empty_strided(tuple(e.shape), e.stride, dtype=stored.dtype)
    laid.copy_(full)
    flat = memory_order_flat(laid).view(torch.uint8)
    if row.is_cuda:
        flat = flat.pin_memory()
    seg = L.Segment(
        e.base,
        e.source.row_numel,
        0,
        e.numel,
        0,
        0,
        L.kind_of(e.source.dtype),
        L.kind_of(stored.dtype),
    )
    _ops.copy_in([flat], L.segment_table([seg]), row, first_row)
    if row.is_cuda:
        torch.cuda.current_stream(row.device).synchronize()
