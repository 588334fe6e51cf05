"""Node-local transport: no collective moves data. Every rank on rank 0's host writes
its *own* pieces (_pieces.py) of every parameter straight to their final offsets in a
shared file — a shared-memory region (a memfd of rank 0, else a /dev/shm file) that
becomes rank 0's output tensors, or the checkpoint file itself — with ``pwrite`` (through a small staging buffer when
casting). Writes go to the shared page cache, so no rank's RSS grows by more than
that staging buffer. Ranks on other hosts send their pieces to rank 0 point to point
(_forward.py), which writes them the same way.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import uuid
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from . import _forward, _pieces
from ._pieces import pieces_of
from ._plan import Entry, GatherPlan

SHM_DIR = "/dev/shm"
# Per process group (world size + identity of the default group): probed once each.
_HOSTS: dict[tuple[int, int], list[str]] = {}


def _host_id() -> str:
    """What identifies "the same host" (a shared /dev/shm and page cache). Hostname plus
    boot id; ``SHARDGATHER_HOST_ID`` overrides it (containers sharing one hostname but
    not /dev/shm, or tests that pretend ranks live on several hosts)."""
    override = os.environ.get("SHARDGATHER_HOST_ID")
    if override:
        return override
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot}"


def host_ids() -> list[str]:
    """Every global rank's host id (exchanged once per world, then cached)."""
    if not dist.is_initialized():
        return [_host_id()]
    world = dist.get_world_size()
    key = (world, id(dist.group.WORLD))
    if key not in _HOSTS:
        hosts: list[object] = [None] * world
        dist.all_gather_object(hosts, _host_id())
        _HOSTS[key] = [str(h) for h in hosts]
    return _HOSTS[key]


_MEMFD: dict[tuple[int, int], bool] = {}


def memfd_shareable() -> bool:
    """Whether the ranks on rank 0's host can open a memfd of rank 0 through
    /proc/<pid>/fd (same pid namespace and user). Probed once per world, collectively;
    the same answer on every rank."""
    if not hasattr(os, "memfd_create"):
        return False
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    world, rank = dist.get_world_size(), dist.get_rank()
    key = (world, id(dist.group.WORLD))
    if key not in _MEMFD:
        hosts = host_ids()  # collective: every rank, before anything rank-dependent
        fd = -1
        path: list[str | None] = [None]
        if rank == 0:
            try:
                fd = os.memfd_create("shardgather-probe", os.MFD_CLOEXEC)
                path[0] = f"/proc/{os.getpid()}/fd/{fd}"
            except OSError:
                pass
        dist.broadcast_object_list(path, src=0)
        ok = path[0] is not None
        if ok and rank != 0 and hosts[rank] == hosts[0]:
            try:
                os.close(os.open(str(path[0]), os.O_WRONLY))
            except OSError:
                ok = False
        oks: list[object] = [None] * world
        dist.all_gather_object(oks, ok)
        if fd >= 0:
            os.close(fd)
        _MEMFD[key] = all(bool(o) for o in oks)
    return _MEMFD[key]


def remote_pieces(
    plan: GatherPlan, participating: Callable[[int], bool]
) -> dict[int, list[_pieces.Piece]]:
    """The pieces of every global rank that holds some but runs on another host than
    rank 0 (in rank order): they travel to rank 0 point to point (_forward.py);
    everyone else writes its own."""
    hosts = host_ids()
    if len(set(hosts)) == 1:
        return {}
    ranks: set[int] = set()
    for src in plan.sources:
        if src.group is not None and participating(src.index):
            ranks.update(r for r in src.group_ranks if hosts[r] != hosts[0])
    held = {r: pieces_of(plan, participating, r) for r in sorted(ranks)}
    return {r: pcs for r, pcs in held.items() if pcs}


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


class HeldRegions:
    """A node-local gather's shared-memory regions, kept open between calls (by a
    :class:`shardgather.Gatherer`): a repeated gather writes into the same, already
    faulted-in pages and needs none of the hand-off collectives (creating, naming,
    opening). ``key`` is the plan fingerprint they were made for."""

    def __init__(self) -> None:
        self.key: str | None = None
        self.fds: dict[torch.dtype, int] = {}
        self.regions: dict[torch.dtype, torch.Tensor] = {}

    def close(self) -> None:
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.key, self.fds, self.regions = None, {}, {}

    def __del__(self) -> None:  # a gatherer dropped without close() leaks no fds
        self.close()


def gather_to_shm(
    plan: GatherPlan,
    participating: Callable[[int], bool],
    copy_local: Callable[[torch.Tensor, Entry, torch.Tensor], None],
    timeout: datetime.timedelta,
    agree_ok: Callable[[bool, str], list[str]],
    message_bytes: int,
    held: HeldRegions | None = None,
) -> dict[str, torch.Tensor] | None:
    """Every participating rank on rank 0's host writes its pieces into shared-memory
    regions (one per dtype) that rank 0 maps; ranks elsewhere send theirs to rank 0.
    Returns rank 0's output tensors (views of the regions), None elsewhere.

    A region is a memfd of rank 0 that the other ranks open through /proc (no name
    anywhere, so nothing can leak, and no room needed in /dev/shm, which containers cap
    at 64 MiB), or else a /dev/shm file unlinked as soon as every rank has opened it.
    Each is freed when its last output view dies.

    With ``held``, the regions stay open after the call and a later call with the same
    plan writes into them again (every rank's ``held`` has the same history, so all
    take the same branch).
    """
    offsets, sizes = shm_layout(plan)
    remote = remote_pieces(plan, participating)
    if held is not None and held.key == plan.fingerprint:
        fds, regions, error = held.fds, held.regions, ""
    else:
        if held is not None:
            held.close()
        fds, regions, error = _open_regions(plan, sizes, remote)
    return _fill(
        plan,
        participating,
        remote,
        fds,
        regions,
        offsets,
        copy_local,
        timeout,
        agree_ok,
        message_bytes,
        held,
        error,
    )


def _open_regions(
    plan: GatherPlan, sizes: dict[torch.dtype, int], remote: dict[int, list[_pieces.Piece]]
) -> tuple[dict[torch.dtype, int], dict[torch.dtype, torch.Tensor], str]:
    """Rank 0 creates one region per dtype and names it to the others, who open it (the
    hand-off collectives): (fds, rank 0's mapped regions, this rank's error or "")."""
    rank = plan.rank
    dtypes = list(sizes)
    hosts = host_ids()  # collectives first, on every rank
    memfd = memfd_shareable()
    tag = uuid.uuid4().hex
    names: list[list[str]] = [[]]
    fds: dict[torch.dtype, int] = {}
    error = ""
    if rank == 0:
        for i, dt in enumerate(dtypes):
            if memfd:
                fds[dt] = os.memfd_create(f"shardgather-{tag}-{i}", os.MFD_CLOEXEC)
                names[0].append(f"/proc/{os.getpid()}/fd/{fds[dt]}")
            else:
                names[0].append(f"{SHM_DIR}/shardgather-{tag}-{i}")
                fds[dt] = os.open(names[0][-1], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            name = names[0][-1]
            try:
                os.ftruncate(fds[dt], sizes[dt])
            except OSError as exc:
                error = f"cannot size {name} to {sizes[dt]} bytes: {exc}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(names, src=0)
        if rank != 0 and rank not in remote and hosts[rank] == hosts[0]:
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
                if not memfd:
                    os.unlink(name)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        if rank == 0 and not memfd:
            for name in names[0]:
                if os.path.exists(name):
                    os.unlink(name)
    return fds, regions, error


def _fill(
    plan: GatherPlan,
    participating: Callable[[int], bool],
    remote: dict[int, list[_pieces.Piece]],
    fds: dict[torch.dtype, int],
    regions: dict[torch.dtype, torch.Tensor],
    offsets: dict[str, tuple[torch.dtype, int]],
    copy_local: Callable[[torch.Tensor, Entry, torch.Tensor], None],
    timeout: datetime.timedelta,
    agree_ok: Callable[[bool, str], list[str]],
    message_bytes: int,
    held: HeldRegions | None,
    error: str = "",
) -> dict[str, torch.Tensor] | None:
    """Every rank writes its pieces into the open regions; all agree; the fds are kept
    in ``held`` (or closed)."""
    rank = plan.rank
    try:
        # Even after a local failure: the exchange with remote ranks must run its course.
        got = _write_everything(
            plan,
            participating,
            remote,
            lambda e: fds[e.target_dtype],
            lambda e: offsets[e.key][1],
            message_bytes,
            timeout,
        )
        error = error or got
        if rank == 0 and not error:
            for key, e in plan.entries.items():
                if e.source.group is None:
                    copy_local(e.source.local(), e, _view(regions, offsets[key], e))
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    failures = agree_ok(not error, error)
    if held is not None and not failures:
        held.key, held.fds, held.regions = plan.fingerprint, fds, regions
    else:
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        if held is not None:
            held.key, held.fds, held.regions = None, {}, {}
    if failures:
        from .errors import CollectiveError

        raise CollectiveError("node-local gather failed: " + "; ".join(failures))
    if rank != 0:
        return None
    return {key: _view(regions, offsets[key], e) for key, e in plan.entries.items()}


def _write_everything(
    plan: GatherPlan,
    participating: Callable[[int], bool],
    remote: dict[int, list[_pieces.Piece]],
    fd_of: Callable[[Entry], int],
    offset_of: Callable[[Entry], int],
    message_bytes: int,
    timeout: datetime.timedelta,
) -> str:
    """This rank's share of the work: write its own pieces (on rank 0's host), or send
    them to rank 0 (elsewhere); rank 0 also writes what the remote ranks send. Returns
    "" or what failed; keeps exchanging after a local failure so no peer hangs."""
    rank = plan.rank
    mine = pieces_of(plan, participating)
    if rank in remote:
        return _forward.send_pieces(mine, message_bytes, timeout)
    error = ""
    try:
        by_fd: dict[int, list[_pieces.Piece]] = {}
        for pc in mine:
            by_fd.setdefault(fd_of(pc.entry), []).append(pc)
        for fd, pcs in by_fd.items():
            _pieces.write_pieces(fd, pcs, offset_of)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    if rank == 0:
        buffers: dict[str, list[torch.Tensor]] = {}
        for sender, pieces in remote.items():
            got = _forward.receive_pieces(
                sender,
                pieces,
                message_bytes,
                fd_of,
                offset_of,
                timeout,
                buffers,
            )
            error = error or got
    return error


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
    fd_of: Callable[[Entry], int],
    offset_of: Callable[[Entry], int],
    participating: Callable[[int], bool],
    message_bytes: int,
    timeout: datetime.timedelta,
    shared_filesystem: bool = False,
) -> str:
    """Every rank on rank 0's host (every rank, on a shared filesystem) pwrites its
    pieces into the (already created) output files, ``fd_of(entry)`` being this rank's
    descriptor of the entry's file; ranks elsewhere send theirs to rank 0, which writes
    them. Returns "" or what failed here."""
    remote = {} if shared_filesystem else remote_pieces(plan, participating)
    return _write_everything(plan, participating, remote, fd_of, offset_of, message_bytes, timeout)


def usable_for(plan: GatherPlan, rank0_only: bool, *, need_contiguous: bool) -> str | None:
    """Why the node-local transport cannot serve this call (None: it can)."""
    if not rank0_only:
        return "rank0_only=False"
    if all(e.source.group is None for e in plan.entries.values()):
        return "nothing is sharded"  # plain tensors: private memory, no /dev/shm
    for e in plan.entries.values():
        if e.source.group is None:
            continue
        if need_contiguous and not e.is_contiguous:
            return f"{e.key} is not contiguous"
    return None


def choose(
    plan: GatherPlan, transport: str, rank0_only: bool, need_contiguous: bool, shm_bytes: int | None
) -> bool:
    """Whether to use the node-local transport; the same answer on every rank.

    Args:
        transport: "auto" (node-local when possible), "node-local" (required: warn and
            fall back when impossible) or "collective".
        shm_bytes: bytes needed in /dev/shm (None: no shared memory needed).
    """
    if transport == "collective":
        return False
    why = usable_for(plan, rank0_only, need_contiguous=need_contiguous)
    if why is None and shm_bytes is not None and not memfd_shareable():
        # Only rank 0's view of /dev/shm matters: it creates the region.
        free = [shm_free_bytes() if plan.rank == 0 else 0]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(free, src=0)
        if free[0] < shm_bytes + 64 * 2**20:
            why = f"{SHM_DIR} has {free[0] >> 20} MiB free, {shm_bytes >> 20} MiB needed"
    if why is not None and transport != "auto":
        warn_once(f"shardgather: node-local transport unavailable ({why}); using collectives")
    return why is None
