"""The file sink: an agreed plan streamed into one safetensors file or into the sharded
directory ``save_pretrained`` writes, atomically.

The headers, the file each entry lands in and its offset follow from the plan alone, so
every rank knows them without a message. Rank 0 creates the temporary file(s) (sized,
headers written), every rank learns their names, then each rank writes its own pieces
where they belong (node-local) or rank 0 writes what bucketed collectives bring it.
Every rank fsyncs what it wrote, the ranks agree, and rank 0 publishes (io/publish.py).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from . import _layout as L
from . import _node_local, _ops
from ._collectives import bucket_parts, gather_buckets, my_buckets, use_gather
from ._options import DEFAULT_TIMEOUT, Progress, default_bucket_mb
from ._pieces import copy_local
from ._plan import Entry, GatherPlan, memory_order_flat
from .api import all_ok
from .errors import CheckpointError, CollectiveError
from .io import hf_layout
from .io.publish import publish_dir, publish_file
from .io.safetensors_format import ALIASES_KEY, encode_header, pwrite_from


@dataclass
class FileSet:
    """What one save writes: the files' names, headers and sizes, and where each primary
    entry's bytes go. One file (``directory=False``) or an HF directory."""

    final: str  # the file, or the directory, that appears at the end
    directory: bool
    names: list[str]  # file names (in the directory; the final's own name for one file)
    headers: list[bytes]
    sizes: list[int]  # whole-file sizes
    where: dict[str, tuple[int, int]]  # primary model key -> (file index, absolute offset)
    extra: dict[str, bytes] = field(default_factory=dict)  # index and pass-through files

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)


def _file_order(plan: GatherPlan) -> list[Entry]:
    # The plain model's state_dict order, whatever the wrapping: FSDP1, FSDP2 and an
    # unwrapped model write the same bytes (hashable, comparable exports), and the order
    # is the one transformers writes. Each rank still writes its pieces where they fall.
    return [plan.entries[k] for k in plan.keys if k in plan.entries]


def file_set(
    plan: GatherPlan,
    path: str | os.PathLike,
    *,
    metadata: dict[str, str] | None = None,
    stored_names: dict[str, str] | None = None,
    max_shard_size: int | None = None,
    files: dict[str, bytes] | None = None,
) -> FileSet:
    """Lay the plan out in files, in the model's key order.

    ``stored_names``: model key -> name in the file (key_map applied; identity if None).
    ``max_shard_size``: bytes per file of an HF directory at ``path`` (None: one file).
    """
    name_of = stored_names or {k: k for k in plan.keys}
    order = _file_order(plan)
    fs = lay_out(
        [(name_of[e.key], e.target_dtype, tuple(e.shape)) for e in order],
        path,
        metadata=metadata,
        max_shard_size=max_shard_size,
        files=files,
        aliases={name_of[a]: name_of[p] for a, p in plan.aliases.items()},
        total_parameters=sum(e.numel for e in plan.entries.values() if not e.is_buffer),
    )
    fs.where = {e.key: fs.where[name_of[e.key]] for e in order}
    return fs


def lay_out(
    tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
    path: str | os.PathLike,
    *,
    metadata: dict[str, str] | None = None,
    max_shard_size: int | None = None,
    files: dict[str, bytes] | None = None,
    aliases: dict[str, str] | None = None,
    total_parameters: int | None = None,
) -> FileSet:
    """Files for ``(stored name, dtype, shape)`` tensors in this order (``where`` keyed
    by stored name); ``aliases``: alias -> stored name, recorded in its tensor's file."""
    nbytes = {}
    for name, dtype, shape in tensors:
        n = dtype.itemsize
        for d in shape:
            n *= d
        nbytes[name] = n
    info = {name: (dtype, shape) for name, dtype, shape in tensors}
    if max_shard_size is None:
        groups = [[name for name, _, _ in tensors]]
        names = [os.path.basename(os.fspath(path))]
    else:
        groups = hf_layout.split_shards([(n, nbytes[n]) for n, _, _ in tensors], max_shard_size)
        names = hf_layout.shard_names(len(groups))
    headers: list[bytes] = []
    sizes: list[int] = []
    where: dict[str, tuple[int, int]] = {}
    weight_map: dict[str, str] = {}
    for i, keys in enumerate(groups):
        layout: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        pos = 0
        for k in keys:
            layout[k] = (info[k][0], info[k][1], pos, pos + nbytes[k])
            pos += nbytes[k]
            weight_map[k] = names[i]
        meta = dict(metadata or {})
        meta["format"] = "pt"
        # Tied aliases are recorded with their tensor, in the file that stores it.
        here = set(keys)
        tied = {a: p for a, p in (aliases or {}).items() if p in here}
        if tied:
            meta[ALIASES_KEY] = json.dumps(tied)
        header = encode_header(layout, meta)
        for k in keys:
            where[k] = (i, len(header) + layout[k][2])
        headers.append(header)
        sizes.append(len(header) + pos)
    extra = dict(files or {})
    if max_shard_size is not None and len(groups) > 1:
        total = sum(nbytes.values())
        extra[hf_layout.INDEX_FILE] = hf_layout.index_document(
            weight_map,
            total,
            total_parameters
            if total_parameters is not None
            else sum(nbytes[n] // info[n][0].itemsize for n in nbytes),
        )
    return FileSet(
        final=os.path.abspath(os.fspath(path)),
        directory=max_shard_size is not None,
        names=names,
        headers=headers,
        sizes=sizes,
        where=where,
        extra=extra,
    )


def write_alone(fs: FileSet, fill: Any) -> None:
    """One process writes the whole file set: ``fill(fds, where)`` pwrites every
    tensor (``fds[i]`` is file ``i``'s descriptor, ``where`` as in the FileSet); then
    fsync and atomic publishing, or nothing left behind on any error."""
    tmp, _paths, fds = _create(fs)
    try:
        fill(fds, fs.where)
        for fd in fds:
            os.fsync(fd)
    except BaseException:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        _remove(tmp)
        raise
    for fd in fds:
        os.close(fd)
    try:
        _publish(fs, tmp)
    except BaseException:
        _remove(tmp)
        raise


class _OpenFiles:
    """This rank's descriptors of the temporary files, opened on first use (a rank
    that only sends pieces to rank 0 opens none); fsync'ed and closed at the end."""

    def __init__(self, paths: list[str], fds: list[int] | None = None) -> None:
        self.paths = paths
        self.fds: dict[int, int] = dict(enumerate(fds)) if fds else {}

    def fd(self, i: int) -> int:
        if i not in self.fds:
            self.fds[i] = os.open(self.paths[i], os.O_WRONLY)
        return self.fds[i]

    def sync(self) -> None:
        # Every writer flushes its own writes: rank 0's fsync could run before another
        # rank's pwrite reached the page cache, and the rename would outlive the data.
        for fd in self.fds.values():
            os.fsync(fd)

    def close(self) -> None:
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()


def _create(fs: FileSet) -> tuple[str, list[str], list[int]]:
    """Rank 0: the temporary file (or directory and files), sized, headers written, the
    index and pass-through files complete. Returns (temp path, file paths, fds)."""
    parent = os.path.dirname(fs.final) or "."
    base = os.path.basename(fs.final)
    if fs.directory:
        if os.path.lexists(fs.final) and not os.path.isdir(fs.final):
            raise OSError(f"{fs.final!r} exists and is not a directory")
        tmp = tempfile.mkdtemp(prefix=f".{base}.", suffix=".tmp", dir=parent)
        paths = [os.path.join(tmp, n) for n in fs.names]
    else:
        if os.path.isdir(fs.final):
            raise OSError(
                f"{fs.final!r} is a directory; pass max_shard_size= to write the Hugging Face "
                "directory layout there, or a file path"
            )
        fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=parent)
        os.close(fd)
        paths = [tmp]
    fds: list[int] = []
    try:
        for p, header, size in zip(paths, fs.headers, fs.sizes):
            fds.append(os.open(p, os.O_RDWR | os.O_CREAT, 0o644))
            os.ftruncate(fds[-1], size)
            os.pwrite(fds[-1], header, 0)
        for name, data in fs.extra.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        for fd in fds:
            os.close(fd)
        _remove(tmp)
        raise
    return tmp, paths, fds


def _remove(tmp: str | None) -> None:
    if tmp is None:
        return
    if os.path.isdir(tmp) and not os.path.islink(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
    elif os.path.lexists(tmp):
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _publish(fs: FileSet, tmp: str) -> None:
    if fs.directory:
        # Files of an existing directory that are not weights (config.json, tokenizer,
        # README) stay; old shards and indexes go, or a loader would mix them in.
        publish_dir(tmp, fs.final, keep=lambda n: not hf_layout.is_weights_file(n))
    else:
        publish_file(tmp, fs.final)


def save_plan(
    plan: GatherPlan,
    fs: FileSet,
    *,
    bucket_mb: float | None = None,
    progress: bool = False,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    transport: str = "auto",
    shared_filesystem: bool = False,
    what: str = "save_full_state_dict",
) -> None:
    """Stream an agreed plan's entries into the files of ``fs``, atomically (the engine
    behind save_full_state_dict; optimizer state uses it too)."""
    bucket_mb = bucket_mb if bucket_mb is not None else default_bucket_mb(plan)
    parallel = _node_local.choose(plan, transport, True, need_contiguous=True, shm_bytes=None)
    writer = plan.rank == 0
    tmp: str | None = None
    paths: list[str] = []
    fds: list[int] = []
    error = ""
    if writer:
        try:
            tmp, paths, fds = _create(fs)
        except OSError as exc:
            error = f"rank 0 cannot create the output beside {fs.final!r}: {exc}"
    # Every rank learns the temporary names, or that there are none, before any data
    # moves: a writer that cannot write must not leave the others in a collective.
    created: list[Any] = [tmp, paths, error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(created, src=0)
    tmp, paths, error = created
    if error:
        raise CheckpointError(
            f"{what}({fs.final!r}): {error}. Check that the directory exists and is writable "
            "on rank 0; nothing was written."
        )
    out = _OpenFiles(paths, fds if writer else None)

    def target(e: Entry) -> tuple[int, int]:
        i, offset = fs.where[e.key]
        return out.fd(i), offset

    try:
        local_failure: Exception | None = None
        if writer:
            try:
                _write_unsharded(plan, target)
            except Exception as exc:  # still take part in the exchange below
                local_failure = exc
        if parallel:
            got = _node_local.parallel_file_write(
                plan,
                lambda e: target(e)[0],
                lambda e: target(e)[1],
                lambda i: 0 in plan.sources[i].group_ranks,
                int(bucket_mb * 2**20),
                timeout,
                shared_filesystem,
            )
            if local_failure is not None:
                raise local_failure
            if got:
                raise OSError(got)
        else:
            _stream(plan, target, writer, bucket_mb, progress, timeout, local_failure)
        out.sync()
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            out.close()
            if writer:
                _remove(tmp)
            raise
    failures = all_ok(not error, error)
    out.close()
    if failures:
        if writer:
            _remove(tmp)
        raise CollectiveError(
            f"{what}({fs.final!r}) failed, nothing was written: " + "; ".join(failures)
        )
    if writer:
        assert tmp is not None
        _publish(fs, tmp)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()  # the output exists for everyone once save returns


def _write_unsharded(plan: GatherPlan, target: Any) -> None:
    """Rank 0 writes the entries every rank holds in full (buffers, unsharded params).

    Runs before the exchange; a failure is raised after this rank took part in it."""
    for e in plan.entries.values():
        if e.source.group is None:
            full = torch.empty_strided(tuple(e.shape), e.stride, dtype=e.target_dtype)
            copy_local(e.source.local(), e, full)
            fd, offset = target(e)
            pwrite_from(fd, full.contiguous().reshape(-1).view(torch.uint8), offset)


def _stream(
    plan: GatherPlan,
    target: Any,
    writer: bool,
    bucket_mb: float,
    progress: bool,
    timeout: datetime.timedelta,
    failure: BaseException | None = None,
) -> None:
    """Gather bucket by bucket; the writer copies each into a reused slab and pwrites it.

    A local failure (e.g. the disk fills up) does not stop this rank's collectives: it
    keeps gathering, without writing, so that every rank reaches the final agreement
    together and raises the same error instead of waiting for a timeout.
    """
    total = sum(e.nbytes for e in plan.entries.values() if e.source.group is not None)
    bar = Progress(progress and writer, total, "shardgather: save")
    sink = _FileSink(target)
    try:
        buckets = my_buckets(plan, bucket_mb, True)
        by_source = plan.entries_by_source()
        for bucket, rows in gather_buckets(
            buckets, lambda b: writer, timeout=timeout, use_gather=use_gather(buckets, True)
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
    """Copies gathered rows into a reused slab in file order and pwrites the ranges
    (``target(entry)``: the fd and absolute offset of its first byte)."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.slab = torch.empty(0, dtype=torch.uint8)
        # Non-contiguous (e.g. channels_last) entries are assembled whole, then written
        # row-major: safetensors stores C-order bytes.
        self.pending: dict[str, tuple[torch.Tensor, list[int]]] = {}

    def write(self, rows: torch.Tensor, parts: list) -> None:
        segs: list[L.Segment] = []
        writes: list[tuple[int, int, int, int]] = []  # (fd, slab offset, file offset, bytes)
        off = 0
        for p in parts:
            e = p.entry
            size = e.target_dtype.itemsize
            if not e.is_contiguous:
                self._write_strided(rows, p)
                continue
            off = (off + size - 1) // size * size
            segs.append(p.segment.with_dst(0, off))
            fd, base = self.target(e)
            writes.append((fd, off, base + p.start * size, p.numel * size))
            off += p.numel * size
        if self.slab.numel() < off:
            self.slab = torch.empty(off, dtype=torch.uint8)
        if segs:
            _ops.copy_out(rows, 0, L.segment_table(segs), [self.slab])
        for fd, s_off, f_off, n in _coalesce(writes):
            pwrite_from(fd, self.slab[s_off : s_off + n], f_off)

    def _write_strided(self, rows: torch.Tensor, p: Any) -> None:
        e = p.entry
        if e.key not in self.pending:
            t = torch.empty_strided(tuple(e.shape), e.stride, dtype=e.target_dtype)
            self.pending[e.key] = (t, [e.numel])
        t, left = self.pending[e.key]
        seg = p.segment.with_dst(0, p.start * e.target_dtype.itemsize)
        _ops.copy_out(rows, 0, L.segment_table([seg]), [memory_order_flat(t)])
        left[0] -= p.numel
        if left[0] == 0:
            fd, offset = self.target(e)
            pwrite_from(fd, t.contiguous().reshape(-1).view(torch.uint8), offset)
            del self.pending[e.key]


def _coalesce(writes: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    out: list[tuple[int, int, int, int]] = []
    for fd, s, f, n in sorted(writes, key=lambda w: (w[0], w[2])):
        if (
            out
            and out[-1][0] == fd
            and out[-1][1] + out[-1][3] == s
            and out[-1][2] + out[-1][3] == f
        ):
            out[-1] = (fd, out[-1][1], out[-1][2], out[-1][3] + n)
        else:
            out.append((fd, s, f, n))
    return out
