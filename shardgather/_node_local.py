"""Node-local transport: no collective moves data. Every rank writes its *own*
pieces of every parameter straight to their final offsets in a shared file — a
/dev/shm region that becomes rank 0's output tensors, or the checkpoint file itself.

From the plan, a rank's elements of an entry are one contiguous run in its local
shard and one contiguous run in the destination (FSDP1: a shard is a contiguous
range of the flat parameter; FSDP2: a shard is a contiguous dim-0 row range), so a
rank's work is a short list of (local offset, destination offset, count) pieces,
written with ``pwrite`` (through a small staging buffer when casting). Writes go to
the shared page cache, so no rank's RSS grows by more than that staging buffer.
"""

from __future__ import annotations

import datetime
import os
import socket
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import _layout as L
from . import _ops
from ._plan import Entry, GatherPlan
from .io.safetensors_format import pwrite_from

SHM_DIR = "/dev/shm"
_STAGING_BYTES = 16 * 2**20
_HOSTS: dict[int, list[str]] = {}


def _host_id() -> str:
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot}"


def all_on_one_host() -> bool:
    """Whether every rank runs on rank 0's host (exchanged once per world, then cached)."""
    if not dist.is_initialized():
        return True
    world = dist.get_world_size()
    if world not in _HOSTS:
        hosts: list[object] = [None] * world
        dist.all_gather_object(hosts, _host_id())
        _HOSTS[world] = [str(h) for h in hosts]
    return len(set(_HOSTS[world])) == 1


@dataclass
class Piece:
    entry: Entry
    local_elem: int  # first element in this rank's local row
    dst_elem: int  # first element in the entry (memory order)
    numel: int


def my_pieces(plan: GatherPlan, participating: Callable[[int], bool]) -> list[Piece]:
    """This rank's contiguous runs of every gathered entry (group rows it holds)."""
    out: list[Piece] = []
    for e in plan.entries.values():
        src = e.source
        if src.group is None or not participating(src.index) or e.numel == 0:
            continue
        p = src.row_numel
        lo = min(max(src.rank * p - e.base, 0), e.numel)
        hi = min(max((src.rank + 1) * p - e.base, 0), e.numel)
        if hi > lo:
            out.append(Piece(e, e.base + lo - src.rank * p, lo, hi - lo))
    return out


def write_pieces(fd: int, pieces: list[Piece], offset_of: Callable[[Entry], int]) -> None:
    """pwrite each piece at ``offset_of(entry) + dst_elem * itemsize``; same-dtype pieces
    go straight from the local shard, casts through a reused staging buffer."""
    staging = torch.empty(0, dtype=torch.uint8)
    for pc in pieces:
        e = pc.entry
        local = e.source.local()
        chunk = local[pc.local_elem : pc.local_elem + pc.numel]
        out_size = e.target_dtype.itemsize
        base = offset_of(e) + pc.dst_elem * out_size
        if e.target_dtype == local.dtype:
            pwrite_from(fd, chunk.contiguous().view(torch.uint8), base)
            continue
        step = max(1, _STAGING_BYTES // out_size)
        for a in range(0, pc.numel, step):
            n = min(step, pc.numel - a)
            if staging.numel() < n * out_size:
                staging = torch.empty(n * out_size, dtype=torch.uint8)
            part = chunk[a : a + n]
            rows = part.view(torch.uint8).view(1, -1)
            seg = L.Segment(0, n, 0, n, 0, 0, L.kind_of(part.dtype), L.kind_of(e.target_dtype))
            _ops.copy_out(rows, 0, L.segment_table([seg]), [staging[: n * out_size]])
            pwrite_from(fd, staging[: n * out_size], base + a * out_size)


def shm_free_bytes() -> int:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


_WARNED: set[str] = set()


def warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _align(n: int, a: int = 64) -> int:
    return (n + a - 1) // a * a


def shm_layout(
    plan: GatherPlan,
) -> tuple[dict[str, tuple[torch.dtype, int]], dict[torch.dtype, int]]:
    """Where every primary entry lives: one region per output dtype (torch.save refuses
    views of one storage as different dtypes), and each region's size in bytes."""
    offsets: dict[str, tuple[torch.dtype, int]] = {}
    sizes: dict[torch.dtype, int] = {}
    for key, e in plan.entries.items():
        pos = sizes.get(e.target_dtype, 0)
        offsets[key] = (e.target_dtype, pos)
        sizes[e.target_dtype] = _align(pos + e.nbytes)
    return offsets, {dt: max(n, 64) for dt, n in sizes.items()}


def gather_to_shm(
    plan: GatherPlan,
    participating: Callable[[int], bool],
    copy_local: Callable[[torch.Tensor, Entry, torch.Tensor], None],
    timeout: datetime.timedelta,
    agree_ok: Callable[[bool, str], list[str]],
) -> dict[str, torch.Tensor] | None:
    """Every participating rank writes its pieces into /dev/shm regions (one per dtype)
    that rank 0 maps; returns rank 0's output tensors (views of them), None elsewhere.

    The regions are unlinked as soon as every rank has opened them, so nothing is left
    in /dev/shm even if a rank dies; each is freed when its last output view dies.
    """
    rank = plan.rank
    offsets, sizes = shm_layout(plan)
    dtypes = list(sizes)
    tag = uuid.uuid4().hex
    names = [[f"{SHM_DIR}/shardgather-{tag}-{i}" for i in range(len(dtypes))] if rank == 0 else []]
    fds: dict[torch.dtype, int] = {}
    error = ""
    if rank == 0:
        for dt, name in zip(dtypes, names[0]):
            fds[dt] = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fds[dt], sizes[dt])
            except OSError as exc:
                error = f"cannot size {name} to {sizes[dt]} bytes: {exc}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(names, src=0)
        if rank != 0:
            try:
                for dt, name in zip(dtypes, names[0]):
                    fds[dt] = os.open(name, os.O_WRONLY)
            except OSError as exc:
                error = f"cannot open {name}: {exc}"
        dist.barrier()
    regions: dict[torch.dtype, torch.Tensor] = {}
    try:
        if rank == 0:
            # Everyone has them open: unlink now, the mappings and fds keep them alive.
            for dt, name in zip(dtypes, names[0]):
                regions[dt] = torch.from_file(
                    f"/proc/self/fd/{fds[dt]}", shared=True, size=sizes[dt] // dt.itemsize, dtype=dt
                )
                os.unlink(name)
        if not error:
            try:
                pieces = my_pieces(plan, participating)
                for dt, fd in fds.items():
                    write_pieces(
                        fd,
                        [pc for pc in pieces if pc.entry.target_dtype == dt],
                        lambda e: offsets[e.key][1],
                    )
                if rank == 0:
                    for key, e in plan.entries.items():
                        if e.source.group is None:
                            copy_local(e.source.local(), e, _view(regions, offsets[key], e))
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
    finally:
        for fd in fds.values():
            os.close(fd)
        if rank == 0:
            for name in names[0]:
                if os.path.exists(name):
                    os.unlink(name)
    failures = agree_ok(not error, error)
    if failures:
        from .errors import CollectiveError

        raise CollectiveError("node-local gather failed: " + "; ".join(failures))
    if rank != 0:
        return None
    return {key: _view(regions, offsets[key], e) for key, e in plan.entries.items()}


def _view(
    regions: dict[torch.dtype, torch.Tensor], where: tuple[torch.dtype, int], e: Entry
) -> torch.Tensor:
    dt, offset = where
    start = offset // dt.itemsize
    flat = regions[dt][start : start + e.numel]
    if e.is_contiguous:
        return flat.view(tuple(e.shape))
    return flat.as_strided(tuple(e.shape), e.stride)


def parallel_file_write(
    plan: GatherPlan,
    tmp_path: str,
    offsets: dict[str, int],
    participating: Callable[[int], bool],
) -> None:
    """Every rank pwrites its pieces into the (already created) checkpoint temp file."""
    fd = os.open(tmp_path, os.O_WRONLY)
    try:
        write_pieces(fd, my_pieces(plan, participating), lambda e: offsets[e.key])
    finally:
        os.close(fd)


def usable_for(plan: GatherPlan, rank0_only: bool, *, need_contiguous: bool) -> str | None:
    """Why the node-local transport cannot serve this call (None: it can)."""
    if not rank0_only:
        return "rank0_only=False"
    if all(e.source.group is None for e in plan.entries.values()):
        return "nothing is sharded"  # plain tensors: private memory, no /dev/shm
    for e in plan.entries.values():
        if e.source.group is None:
            continue
        if e.source.local().device.type != "cpu":
            return "shards on an accelerator"
        if need_contiguous and not e.is_contiguous:
            return f"{e.key} is not contiguous"
    if not all_on_one_host():
        return "ranks on several hosts"
    return None


def choose(
    plan: GatherPlan, transport: str, rank0_only: bool, need_contiguous: bool, shm_bytes: int | None
) -> bool:
    """Whether to use the node-local transport; the same answer on every rank.

    Args:
        transport: "auto" (node-local when possible), "shm"/"node" (required: warn and
            fall back when impossible) or "collective".
        shm_bytes: bytes needed in /dev/shm (None: no shared memory needed).
    """
    if transport == "collective":
        return False
    why = usable_for(plan, rank0_only, need_contiguous=need_contiguous)
    if why is None and shm_bytes is not None:
        # Only rank 0's view of /dev/shm matters: it creates the region.
        free = [shm_free_bytes() if plan.rank == 0 else 0]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(free, src=0)
        if free[0] < shm_bytes + 64 * 2**20:
            why = f"{SHM_DIR} has {free[0] >> 20} MiB free, {shm_bytes >> 20} MiB needed"
    if why is not None and transport != "auto":
        warn_once(f"shardgather: node-local transport unavailable ({why}); using collectives")
    return why is None
