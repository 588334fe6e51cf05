"""save_full_state_dict / load_full_state_dict / load_file: full safetensors
checkpoints streamed bucket by bucket; loading reads only each rank's own bytes."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import tempfile
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from . import _layout as L
from . import _node_local, _ops
from ._collectives import agree, bucket_parts, gather_buckets, p2p_device, scatter_slice
from ._plan import Entry, GatherPlan, Source, _memory_order_flat, build_plan, reshard_for_load
from .api import (
    DEFAULT_TIMEOUT,
    _copy_local,
    _my_buckets,
    _Progress,
    _use_gather,
    _verify_options,
    _verify_transport,
    all_ok,
    default_bucket_mb,
)
from .errors import CheckpointError, CollectiveError, ShardGatherError, StateDictMismatchError
from .io.hf_layout import KeyMap, is_safetensors_source, map_keys, open_sources, safetensors_files
from .io.safetensors_format import (
    ALIASES_KEY,
    encode_header,
    pread_into,
    pwrite_from,
    read_header,
)


def _file_order(plan: GatherPlan) -> list[Entry]:
    by_source = plan.entries_by_source()
    return [e for s in plan.sources for e in by_source.get(s.index, [])]


def save_full_state_dict(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    metadata: dict[str, str] | None = None,
    bucket_mb: float | None = None,
    progress: bool = False,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    transport: str = "auto",
    shared_filesystem: bool = False,
) -> None:
    """Write the full, unwrapped state dict to one safetensors file, streaming.

    Call on every rank; rank 0 writes. No rank ever holds the whole model: peak extra
    host memory is about two buckets. Tied tensors are stored once and their aliases
    recorded in the header metadata (``shardgather.aliases``), which
    :func:`load_file` and :func:`load_full_state_dict` restore. The file is written
    under a temporary name in the same directory, fsync'ed and renamed: a failure on
    any rank leaves no file (and no temporary) behind, and every rank raises.

    Args:
        model: as for :func:`shardgather.full_state_dict`.
        path: the ``.safetensors`` file to create (replaced if it exists).
        dtype: cast floating-point tensors (e.g. ``torch.bfloat16`` to ship a model).
        metadata: extra ``str -> str`` header metadata.
        bucket_mb, progress, timeout: as for :func:`shardgather.full_state_dict`.
        transport: ``"auto"``: every rank on rank 0's host (the same filesystem)
            pwrites its own pieces into the file in parallel, and ranks on other hosts
            send theirs to rank 0 point to point; ``"collective"``: rank 0 writes what
            bucketed collectives bring it. ``"shm"`` asks for the former (warns once
            and falls back).
        shared_filesystem: ``path`` is on a filesystem every host mounts (NFS,
            Lustre, GPFS...): ranks on other hosts then pwrite their own pieces into
            the file too, instead of sending them to rank 0.

    Raises:
        ShardGatherError: bad arguments; CollectiveError: another rank failed.

    Example:
        >>> shardgather.save_full_state_dict(model, "model.safetensors", dtype=torch.bfloat16)
    """
    _verify_options(model, bucket_mb, dtype)
    _verify_transport(transport, False)
    if metadata is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ShardGatherError("metadata must be a dict of str -> str (safetensors' rule)")
    plan = build_plan(model, dtype=dtype)
    agree(plan, timeout)
    save_plan(
        plan,
        path,
        metadata=metadata,
        bucket_mb=bucket_mb,
        progress=progress,
        timeout=timeout,
        transport=transport,
        shared_filesystem=shared_filesystem,
    )


def save_plan(
    plan: GatherPlan,
    path: str | os.PathLike,
    *,
    metadata: dict[str, str] | None = None,
    bucket_mb: float | None = None,
    progress: bool = False,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    transport: str = "auto",
    shared_filesystem: bool = False,
) -> None:
    """Stream an agreed plan's entries to one safetensors file, atomically (the engine
    behind save_full_state_dict; optimizer state uses it too)."""
    bucket_mb = bucket_mb if bucket_mb is not None else default_bucket_mb(plan)
    parallel = _node_local.choose(plan, transport, True, need_contiguous=True, shm_bytes=None)
    final = os.path.abspath(os.fspath(path))
    writer = plan.rank == 0
    tmp_path: str | None = None
    fd = -1
    error = ""
    # The header follows from the plan alone: every rank knows every file offset.
    layout: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
    pos = 0
    for e in _file_order(plan):
        layout[e.key] = (e.target_dtype, tuple(e.shape), pos, pos + e.nbytes)
        pos += e.nbytes
    meta = dict(metadata or {})
    meta["format"] = "pt"
    if plan.aliases:
        meta[ALIASES_KEY] = json.dumps(plan.aliases)
    header = encode_header(layout, meta)
    offsets = {k: len(header) + v[2] for k, v in layout.items()}
    if writer:
        try:
            directory = os.path.dirname(final) or "."
            fd, tmp_path = tempfile.mkstemp(
                prefix=f".{os.path.basename(final)}.", suffix=".tmp", dir=directory
            )
            os.ftruncate(fd, len(header) + pos)
            os.pwrite(fd, header, 0)
        except OSError as exc:
            error = f"rank 0 cannot create the file in {os.path.dirname(final)!r}: {exc}"
    # Every rank learns the temp file's name, or that there is none, before any data
    # moves: a writer that cannot write must not leave the others in a collective.
    created = [tmp_path, error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(created, src=0)
    if created[1]:
        _cleanup(fd, tmp_path)
        raise CheckpointError(
            f"save_full_state_dict({final!r}): {created[1]}. Check that the directory "
            "exists and is writable on rank 0; nothing was written."
        )
    try:
        if parallel:
            _write_parallel(
                plan,
                fd,
                created[0],
                offsets,
                writer,
                int(bucket_mb * 2**20),
                timeout,
                shared_filesystem,
            )
        else:
            _stream(plan, fd, offsets, writer, bucket_mb, progress, timeout)
        if writer:
            os.fsync(fd)
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            _cleanup(fd, tmp_path)
            raise
    failures = all_ok(not error, error)
    if failures:
        _cleanup(fd, tmp_path)
        raise CollectiveError(
            f"save_full_state_dict({final!r}) failed, nothing was written: " + "; ".join(failures)
        )
    if writer:
        os.close(fd)
        assert tmp_path is not None
        os.replace(tmp_path, final)
        dir_fd = os.open(os.path.dirname(final) or ".", os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()  # the file exists for everyone once save returns


def _write_parallel(
    plan: GatherPlan,
    fd: int,
    tmp_path: str | None,
    offsets: dict[str, int],
    writer: bool,
    message_bytes: int,
    timeout: datetime.timedelta,
    shared_filesystem: bool,
) -> None:
    """Every rank on the writer's host (every rank, on a shared filesystem) pwrites its
    own pieces into the temp file; ranks elsewhere send theirs to the writer. Raises
    what failed here."""
    error = ""
    if writer:
        try:
            for e in plan.entries.values():
                if e.source.group is None:
                    out = torch.empty_strided(tuple(e.shape), e.stride, dtype=e.target_dtype)
                    _copy_local(e.source.local(), e, out)
                    pwrite_from(fd, out.contiguous().reshape(-1).view(torch.uint8), offsets[e.key])
        except Exception as exc:  # still take part in the exchange below
            error = f"{type(exc).__name__}: {exc}"
    assert tmp_path is not None
    got = _node_local.parallel_file_write(
        plan,
        fd,
        tmp_path,
        offsets,
        lambda i: 0 in plan.sources[i].group_ranks,
        message_bytes,
        timeout,
        shared_filesystem,
    )
    if error or got:
        raise OSError(error or got)


def _cleanup(fd: int, tmp_path: str | None) -> None:
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)
    if tmp_path is not None and os.path.exists(tmp_path):
        os.unlink(tmp_path)


def _stream(
    plan: GatherPlan,
    fd: int,
    offsets: dict[str, int],
    writer: bool,
    bucket_mb: float,
    progress: bool,
    timeout: datetime.timedelta,
) -> None:
    """Gather bucket by bucket; the writer copies each into a reused slab and pwrites it.

    A local failure (e.g. the disk fills up) does not stop this rank's collectives: it
    keeps gathering, without writing, so that every rank reaches the final agreement
    together and raises the same error instead of waiting for a timeout.
    """
    total = sum(e.nbytes for e in plan.entries.values())
    bar = _Progress(progress and writer, total, "shardgather: save")
    failure: BaseException | None = None
    sink = _FileSink(fd, offsets)
    try:
        if writer:
            try:
                for e in plan.entries.values():
                    if e.source.group is None:
                        out = torch.empty_strided(tuple(e.shape), e.stride, dtype=e.target_dtype)
                        _copy_local(e.source.local(), e, out)
                        pwrite_from(
                            fd, out.contiguous().reshape(-1).view(torch.uint8), offsets[e.key]
                        )
                        bar.update(e.nbytes)
            except Exception as exc:
                failure = exc
        buckets = _my_buckets(plan, bucket_mb, True)
        by_source = plan.entries_by_source()
        for bucket, rows in gather_buckets(
            buckets, lambda b: writer, timeout=timeout, use_gather=_use_gather(buckets, True)
        ):
            if rows is None or failure is not None:
                continue
            try:
                parts = bucket_parts(bucket, by_source)
                sink.write(rows.cpu() if rows.is_cuda else rows, parts)
                bar.update(sum(p.numel * p.entry.target_dtype.itemsize for p in parts))
            except Exception as exc:
                failure = exc
    finally:
        bar.close()
    if failure is not None:
        raise failure


class _FileSink:
    """Copies gathered rows into a reused slab in file order and pwrites the ranges."""

    def __init__(self, fd: int, offsets: dict[str, int]) -> None:
        self.fd = fd
        self.offsets = offsets
        self.slab = torch.empty(0, dtype=torch.uint8)
        # Non-contiguous (e.g. channels_last) entries are assembled whole, then written
        # row-major: safetensors stores C-order bytes.
        self.pending: dict[str, tuple[torch.Tensor, list[int]]] = {}

    def write(self, rows: torch.Tensor, parts: list) -> None:
        segs: list[L.Segment] = []
        writes: list[tuple[int, int, int]] = []  # (slab offset, file offset, bytes)
        off = 0
        for p in parts:
            e = p.entry
            size = e.target_dtype.itemsize
            if not e.is_contiguous:
                self._write_strided(rows, p)
                continue
            off = (off + size - 1) // size * size
            segs.append(p.segment.with_dst(0, off))
            writes.append((off, self.offsets[e.key] + p.start * size, p.numel * size))
            off += p.numel * size
        if self.slab.numel() < off:
            self.slab = torch.empty(off, dtype=torch.uint8)
        if segs:
            _ops.copy_out(rows, 0, L.segment_table(segs), [self.slab])
        for s_off, f_off, n in _coalesce(writes):
            pwrite_from(self.fd, self.slab[s_off : s_off + n], f_off)

    def _write_strided(self, rows: torch.Tensor, p: Any) -> None:
        e = p.entry
        if e.key not in self.pending:
            t = torch.empty_strided(tuple(e.shape), e.stride, dtype=e.target_dtype)
            self.pending[e.key] = (t, [e.numel])
        t, left = self.pending[e.key]
        seg = p.segment.with_dst(0, p.start * e.target_dtype.itemsize)
        _ops.copy_out(rows, 0, L.segment_table([seg]), [_memory_order_flat(t)])
        left[0] -= p.numel
        if left[0] == 0:
            pwrite_from(self.fd, t.contiguous().reshape(-1).view(torch.uint8), self.offsets[e.key])
            del self.pending[e.key]


def _coalesce(writes: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for s, f, n in sorted(writes, key=lambda w: w[1]):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == f:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((s, f, n))
    return out


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
    _verify_options(model, bucket_mb, None)
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
    if not (is_safetensors_source(path) or _looks_like_safetensors(path)):
        return _load_from_dict(plan, _renamed(_torch_file(path), key_map), strict, path, timeout)
    # Every header (and the index) validated, and the keys matched, before any data moves.
    stored = open_sources(*safetensors_files(path))
    names = map_keys(stored, key_map)
    sources = {model_key: stored[src_key] for model_key, src_key in names.items()}
    shapes = {k: (tuple(info.shape), info.dtype) for k, (_, info) in sources.items()}
    renamed = {k: v for k, v in names.items() if k != v}
    result = _validate(plan, shapes, strict, path, renamed)
    error = ""
    try:
        _read_own_bytes(plan, sources, int(bucket_mb * 2**20))
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    failures = all_ok(not error, error)
    if failures:
        raise CheckpointError(f"load_full_state_dict({path!r}) failed: " + "; ".join(failures))
    return result


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


def _torch_file(path: str, clean: bool = True) -> dict[str, torch.Tensor]:
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


def _receive(t: torch.Tensor | None, meta: tuple[tuple[int, ...], torch.dtype]) -> torch.Tensor:
    """Rank 0's tensor on every rank (one tensor in flight: bounded memory)."""
    shape, dtype = meta
    device = p2p_device()
    if dist.get_rank() == 0:
        assert t is not None
        buf = t.detach().to(device).contiguous()
    else:
        buf = torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(buf, src=0)
    return buf


def _own_range(e: Entry, src: Source | None = None) -> tuple[int, int]:
    """This rank's elements of ``e`` (memory order) in its row of ``src`` (default: the
    entry's own source), or all of a local tensor."""
    src = src or e.source
    return _elems_in_row(e.base, src.row_numel, e.numel, src.rank)


def _flat_of(e: Entry, full: torch.Tensor) -> torch.Tensor:
    """``full`` in ``e``'s memory order, flattened."""
    t = full.detach()
    if not e.is_contiguous:
        t = torch.empty_strided(tuple(e.shape), e.stride, dtype=t.dtype, device=t.device).copy_(t)
    return _memory_order_flat(t.contiguous() if e.is_contiguous else t)


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
    mine = {key: _own_range(e) for key, e in plan.entries.items() if loaded[key] is not None}
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
                flat = _flat_of(e, sd[src_key]).to(device)
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
    lo, hi = _own_range(e)
    if hi > lo:
        _copy_in_slice(e, lo, hi, _flat_of(e, full)[lo:hi])


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


def _elems_in_row(base: int, p: int, numel: int, row: int) -> tuple[int, int]:
    lo = min(max(row * p - base, 0), numel)
    hi = min(max((row + 1) * p - base, 0), numel)
    return lo, max(lo, hi)


def _read_own_bytes(
    plan: GatherPlan, sources: Mapping[str, tuple[str, Any]], staging_bytes: int
) -> None:
    """pread exactly this rank's elements of every entry (from whichever file holds it:
    ``sources`` maps a model key to (file, its tensor)) and copy them into its shards."""
    staging = torch.empty(0, dtype=torch.uint8)
    fds: dict[str, int] = {}
    try:
        for key, e in plan.entries.items():
            src_key = _source_key(plan, key, sources)
            if src_key is None:
                continue
            path, info = sources[src_key]
            if path not in fds:
                fds[path] = os.open(path, os.O_RDONLY)
            fd = fds[path]
            row, first_row = _local_row(e)
            src = e.source
            if not e.is_contiguous:
                _load_strided(fd, e, info, row, first_row)
                continue
            lo, hi = _elems_in_row(e.base, src.row_numel, e.numel, first_row)
            fsize = info.dtype.itemsize
            step = max(1, staging_bytes // fsize)
            for a in range(lo, hi, step):
                b = min(hi, a + step)
                n = (b - a) * fsize
                if staging.numel() < n:
                    # CUDA shards read pinned staging through its mapped address.
                    staging = torch.empty(n, dtype=torch.uint8, pin_memory=row.is_cuda)
                buf = staging[:n]
                pread_into(fd, buf, info.begin + a * fsize)
                seg = L.Segment(
                    e.base + a,
                    src.row_numel,
                    0,
                    b - a,
                    0,
                    0,
                    L.kind_of(src.dtype),
                    L.kind_of(info.dtype),
                )
                _ops.copy_in([buf], L.segment_table([seg]), row, first_row)
                if row.is_cuda:
                    torch.cuda.current_stream(row.device).synchronize()  # the kernel's stream
    finally:
        for fd in fds.values():
            os.close(fd)


def _load_strided(fd: int, e: Entry, info: Any, row: torch.Tensor, first_row: int) -> None:
    """A non-contiguous (e.g. channels_last) entry: the file is row-major, the shard
    holds memory order, so read it whole and re-lay it out first."""
    raw = torch.empty(info.numel * info.dtype.itemsize, dtype=torch.uint8)
    pread_into(fd, raw, info.begin)
    full = raw.view(info.dtype).view(tuple(info.shape))
    laid = torch.empty_strided(tuple(e.shape), e.stride, dtype=info.dtype)
    laid.copy_(full)
    flat = _memory_order_flat(laid).view(torch.uint8)
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
        L.kind_of(info.dtype),
    )
    _ops.copy_in([flat], L.segment_table([seg]), row, first_row)
    if row.is_cuda:
        torch.cuda.current_stream(row.device).synchronize()
