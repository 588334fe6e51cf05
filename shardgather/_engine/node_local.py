"""The node-local transport: no collective moves data. Every rank on rank 0's host
writes its *own* pieces straight to their final offsets in a shared file — a
shared-memory region (a memfd of rank 0, else a /dev/shm file) that becomes rank 0's
output tensors, or the checkpoint file itself — with ``pwrite`` (through a small
buffer when casting). Writes go to the shared page cache, so no rank's RSS grows by
more than that buffer. Ranks on other hosts send their pieces to rank 0 (remote.py).

What the choice needs — which ranks share rank 0's host, whether they can open a
memfd of rank 0 — rank 0 reads from facts the ranks post (their host ids when they
enter a call, a probe's answer): no round, and nothing remembered between calls.
"""

from __future__ import annotations

import contextlib
import os
import uuid
import warnings
from typing import Any

import torch

from .. import _dist
from .._dist import Call
from .._plan import Entry, GatherPlan
from .pieces import pieces_of

SHM_DIR = "/dev/shm"


def host_ids(call: Call) -> list[str]:
    """Every global rank's host id (rank 0 reads them: it alone chooses the transport).
    Each rank posts its own as a fact when it enters a call; nothing is remembered
    between calls, so a failed call cannot leave the ranks deciding differently."""
    if not call.distributed:
        return [_dist.host_id()]
    got = call.facts("host", list(range(call.world)))
    return [h if h is not None else "" for h in got]


# Rank 0's probe: one empty memfd for the life of the process, which the ranks on its
# host try to open through /proc (a fact each posts).
_PROBE: dict[str, Any] = {"fd": -1, "path": ""}


def _probe_path() -> str:
    if _PROBE["fd"] < 0 and hasattr(os, "memfd_create"):
        with contextlib.suppress(OSError):
            _PROBE["fd"] = os.memfd_create("shardgather-probe", os.MFD_CLOEXEC)
            _PROBE["path"] = f"/proc/{os.getpid()}/fd/{_PROBE['fd']}"
    return _PROBE["path"]


def memfd_shareable(call: Call, hosts: list[str]) -> bool:
    """Whether the ranks on rank 0's host can open a memfd of rank 0 through
    /proc/<pid>/fd (same pid namespace and user). Every rank calls it at the same point:
    rank 0 posts its probe's path, the others try it and post the answer (tagged with
    the path, so an answer to another process's probe never counts); rank 0's result is
    the one that matters (it creates the regions and hands their names out)."""
    if not hasattr(os, "memfd_create"):
        return False
    if not call.distributed:
        return True
    if call.rank == 0:
        path = _probe_path()
        call.post_fact("memfd-probe", path)
        if not path:
            return False
        peers = [r for r in range(1, call.world) if hosts[r] == hosts[0]]
        return all(a == f"{path} ok" for a in call.facts("memfd", peers))
    (path,) = call.facts("memfd-probe", [0])
    ok = bool(path)
    if ok:
        try:
            os.close(os.open(path, os.O_WRONLY))  # type: ignore[arg-type]
        except OSError:
            ok = False
    call.post_fact("memfd", f"{path} {'ok' if ok else 'refused'}")
    return ok


def remote_ranks(plan: GatherPlan, hosts: list[str], participating: Any) -> list[int]:
    """Ranks holding pieces of participating sources on another host than rank 0's:
    they send their pieces to rank 0 instead of writing them (rank 0 decides; the plan
    round hands the list to everyone)."""
    if len(set(hosts)) == 1:
        return []
    ranks: set[int] = set()
    for src in plan.sources:
        if src.group is not None and participating(src.index):
            ranks.update(r for r in src.group_ranks if hosts[r] != hosts[0])
    return sorted(r for r in ranks if pieces_of(plan, participating, r))


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
        warnings.warn(msg, RuntimeWarning, stacklevel=4)


def unusable_because(
    plan: GatherPlan, rank0_only: bool, *, need_contiguous: bool, into_memory: bool
) -> str | None:
    """Why the node-local transport cannot serve this plan (None: it can).
    ``into_memory``: the destination is shared memory (else a file)."""
    if not rank0_only:
        return "rank0_only=False"
    if into_memory and all(e.source.group is None for e in plan.entries.values()):
        return "nothing is sharded"  # plain tensors: private memory, no shared region
    if need_contiguous:
        for e in plan.entries.values():
            if e.source.group is not None and not e.is_contiguous:
                return f"{e.key} is not contiguous"
    return None


# ------------------------------------------------------------------------ regions


def _align(n: int, a: int = 64) -> int:
    return (n + a - 1) // a * a


def region_layout(
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


class Regions:
    """One node-local gather's shared-memory regions (one per output dtype): rank 0
    creates and maps them, the other ranks on its host open their fds. Kept open
    between calls by a :class:`shardgather.Gatherer` (``key``: the plan fingerprint
    they were made for), so a repeated gather writes into the same, already faulted-in
    pages and needs no hand-off."""

    def __init__(self) -> None:
        self.key: str | None = None
        self.fds: dict[torch.dtype, int] = {}
        self.views: dict[torch.dtype, torch.Tensor] = {}  # rank 0's mappings
        self.unlink: list[str] = []  # /dev/shm names to remove once everyone opened them

    def create(self, plan: GatherPlan, memfd: bool) -> list[str]:
        """Rank 0: make the regions; returns the names the other ranks open."""
        _, sizes = region_layout(plan)
        tag = uuid.uuid4().hex
        names = []
        for i, (dt, size) in enumerate(sizes.items()):
            if memfd:
                fd = os.memfd_create(f"shardgather-{tag}-{i}", os.MFD_CLOEXEC)
                names.append(f"/proc/{os.getpid()}/fd/{fd}")
            else:
                names.append(f"{SHM_DIR}/shardgather-{tag}-{i}")
                fd = os.open(names[-1], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                self.unlink.append(names[-1])
            self.fds[dt] = fd
            os.ftruncate(fd, size)
            self.views[dt] = torch.from_file(
                f"/proc/self/fd/{fd}", shared=True, size=size // dt.itemsize, dtype=dt
            )
        self.key = plan.fingerprint
        return names

    def open(self, plan: GatherPlan, names: list[str]) -> None:
        """A rank on rank 0's host: open rank 0's regions for writing."""
        _, sizes = region_layout(plan)
        for dt, name in zip(sizes, names):
            self.fds[dt] = os.open(name, os.O_WRONLY)
        self.key = plan.fingerprint

    def release_names(self) -> None:
        """Rank 0, once every rank has its fds: nothing named remains (a /dev/shm file
        is unlinked; the mappings and fds keep it alive)."""
        for name in self.unlink:
            with contextlib.suppress(OSError):
                os.unlink(name)
        self.unlink = []

    def close(self) -> None:
        self.release_names()
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.key, self.fds, self.views = None, {}, {}

    def __del__(self) -> None:  # a gatherer dropped without close() leaks no fds
        self.close()


def view(regions: Regions, where: tuple[torch.dtype, int], e: Entry) -> torch.Tensor:
    dt, offset = where
    start = offset // dt.itemsize
    flat = regions.views[dt][start : start + e.numel]
    if e.is_contiguous:
        return flat.view(tuple(e.shape))
    return flat.as_strided(tuple(e.shape), e.stride)
