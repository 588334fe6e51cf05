"""Buckets and the bucketed gather: one collective per bucket, two buffers in flight.

Every rank walks the same bucket list in the same order (the plan is identical on
every rank), so collectives match. Each collective is waited on with a timeout, and
the ranks agree on the plan before the first one, so a mismatch or a rank that fails
early becomes a :class:`CollectiveError` on every rank instead of a hang.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import _layout as L
from ._plan import Entry, GatherPlan, Source
from .errors import CollectiveError

_ALIGN = 16  # byte alignment of each source's columns in a bucket row (16-byte vectors)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass
class Piece:
    """Columns ``[col_lo, col_hi)`` (elements) of a source, at ``col_byte`` in the bucket row."""

    source: Source
    col_lo: int
    col_hi: int
    col_byte: int

    @property
    def whole(self) -> bool:
        return self.col_lo == 0 and self.col_hi == self.source.row_numel


@dataclass
class Bucket:
    group: dist.ProcessGroup
    world: int
    rank: int  # this process's row in the group
    ranks: tuple[int, ...]  # global ranks of the group
    row_bytes: int
    pieces: list[Piece]

    @property
    def nbytes(self) -> int:
        return self.world * self.row_bytes


def build_buckets(sources: list[Source], bucket_bytes: int) -> list[Bucket]:
    """Pack gathered sources, in plan order, into buckets of at most ``bucket_bytes``
    gathered bytes; a source too big for one bucket is split into column chunks."""
    buckets: list[Bucket] = []
    cur: Bucket | None = None
    for src in sources:
        if src.group is None or src.row_numel == 0:
            continue
        row_cap = max(_ALIGN, bucket_bytes // src.world // _ALIGN * _ALIGN)
        itemsize = src.dtype.itemsize
        col = 0
        while col < src.row_numel:
            if cur is None or cur.group is not src.group or cur.row_bytes >= row_cap:
                cur = Bucket(src.group, src.world, src.rank, src.group_ranks, 0, [])
                buckets.append(cur)
            room = (row_cap - cur.row_bytes) // itemsize
            if room <= 0:
                cur = None
                continue
            take = min(room, src.row_numel - col)
            cur.pieces.append(Piece(src, col, col + take, cur.row_bytes))
            cur.row_bytes = _align(cur.row_bytes + take * itemsize)
            col += take
    return buckets


@dataclass
class SegmentPart:
    """Elements ``[start, start + numel)`` of an entry that one bucket delivers."""

    entry: Entry
    start: int
    numel: int
    segment: L.Segment  # full_index / full_byte filled in by the sink (0 here)


def bucket_parts(bucket: Bucket, by_source: dict[int, list[Entry]]) -> list[SegmentPart]:
    """Where every entry element in ``bucket`` sits in the gathered ``[world, row_bytes]``."""
    parts: list[SegmentPart] = []
    for piece in bucket.pieces:
        src = piece.source
        kind = L.kind_of(src.dtype)
        for e in by_source.get(src.index, []):
            if e.numel == 0:
                continue
            seg = L.Segment(
                e.base,
                src.row_numel,
                piece.col_byte,
                e.numel,
                0,
                0,
                kind,
                L.kind_of(e.target_dtype),
            )
            if piece.whole:
                parts.append(SegmentPart(e, 0, e.numel, seg))
                continue
            out_size = e.target_dtype.itemsize
            for s in L.split_columns(seg, bucket.world, piece.col_lo, piece.col_hi, piece.col_byte):
                start = s.full_byte // out_size
                parts.append(SegmentPart(e, start, s.numel, s))
    return parts


def agree(plan: GatherPlan, timeout: datetime.timedelta) -> None:
    """Check that every rank built the same plan and none failed before gathering.

    Raises:
        CollectiveError: ranks disagree (different models or groups), or one failed.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = plan.fingerprint
    gathered: list[object] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(gathered, mine)
    except Exception as exc:
        raise CollectiveError(
            f"rank {dist.get_rank()}: ranks could not exchange their gather plans ({exc}). "
            "Call shardgather on every rank of the job, with the same model."
        ) from exc
    bad = sorted({str(g) for g in gathered})
    if len(bad) != 1:
        raise CollectiveError(
            f"rank {dist.get_rank()}: ranks built different gather plans {gathered}: the model "
            "is not the same on every rank (different wrapping, shapes or process groups). "
            "Every rank must call shardgather with the same sharded model."
        )


def wait_or_raise(work, timeout: datetime.timedelta, what: str) -> None:  # type: ignore[no-untyped-def]
    try:
        ok = work.wait(timeout)
    except Exception as exc:
        raise CollectiveError(
            f"rank {dist.get_rank()}: {what} failed: {exc}. Another rank probably failed or "
            "left; check its log. No output was produced."
        ) from exc
    if ok is False:
        raise CollectiveError(f"rank {dist.get_rank()}: {what} timed out after {timeout}")


def p2p_device() -> torch.device:
    """Where tensors sent point to point (or broadcast) on the default group must live:
    the CPU when its backend moves CPU tensors (gloo, mpi), else the current GPU."""
    backend = str(dist.get_backend()).lower()
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def scatter_slice(
    flat: torch.Tensor | None,
    ranges: list[tuple[int, int] | None],
    dtype: torch.dtype,
    timeout: datetime.timedelta,
    what: str,
    consume: Callable[[torch.Tensor], None],
) -> None:
    """Rank 0 sends every other rank its ``ranges[rank]`` of ``flat`` (1-D, on
    ``p2p_device()``; None when rank 0 could not build it: zeros go out, so nobody
    hangs), point to point; each rank hands its own slice to ``consume`` (rank 0 while
    its sends are in flight). Every rank calls it for the same tensors in the same order.
    """
    device = p2p_device()
    rank = dist.get_rank()
    lo, hi = ranges[rank] or (0, 0)
    if rank != 0:
        if hi > lo:
            buf = torch.empty(hi - lo, dtype=dtype, device=device)
            wait_or_raise(dist.irecv(buf, src=0), timeout, f"receiving {what} from rank 0")
            consume(buf)
        return
    works = []
    for r, rg in enumerate(ranges):
        if r == 0 or rg is None or rg[1] <= rg[0]:
            continue
        a, b = rg
        part = (
            flat[a:b].contiguous()
            if flat is not None
            else torch.zeros(b - a, dtype=dtype, device=device)
        )
        works.append(dist.isend(part, dst=r))
    if hi > lo and flat is not None:
        consume(flat[lo:hi])
    for w in works:
        wait_or_raise(w, timeout, f"sending {what}")


def _collective_device(bucket: Bucket, fallback: torch.device) -> torch.device:
    backend = dist.get_backend(bucket.group)
    if "nccl" in str(backend).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return fallback


def _direct_row(b: Bucket, device: torch.device) -> torch.Tensor | None:
    """The local shard bytes when they are exactly the bucket row (one full-width piece)."""
    if len(b.pieces) != 1:
        return None
    piece = b.pieces[0]
    local = piece.source.local()
    width = piece.col_hi - piece.col_lo
    if (
        local.device != device
        or local.numel() < piece.col_hi
        or width * piece.source.dtype.itemsize != b.row_bytes
    ):
        return None
    chunk = local[piece.col_lo : piece.col_hi]
    if not chunk.is_contiguous():
        return None
    return chunk.view(torch.uint8) if chunk.element_size() > 1 else chunk


def _point_to_point(b: Bucket, inp: torch.Tensor) -> bool:
    """Whether to move a bucket's rows by point-to-point sends instead of a collective:
    on gloo with CPU rows. Gloo's all-gather and gather receive into a fresh flat
    tensor of the whole gathered bucket and then copy it into the output (one bucket
    allocated, first-touched and copied per call); its receives write into the
    output rows themselves. The same bytes cross the wire."""
    return not inp.is_cuda and "gloo" in str(dist.get_backend(b.group)).lower()


class _Works:
    """Several in-flight sends and receives, waited on as one, within one timeout."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self, timeout: datetime.timedelta) -> bool:
        deadline = time.monotonic() + timeout.total_seconds()
        for w in self.works:
            left = max(deadline - time.monotonic(), 0.001)
            if w.wait(datetime.timedelta(seconds=left)) is False:
                return False
        return True


def _exchange_rows(b: Bucket, inp: torch.Tensor, out: torch.Tensor, to_one: bool) -> _Works:
    """All-gather (or, ``to_one``, gather to the group's first rank) one bucket's rows
    by sends and receives into ``out``'s rows. Every pair of ranks posts its messages
    in bucket order, so they match in order."""
    me = dist.get_rank()
    ranks = list(b.ranks)
    mine = b.rank  # rows are in group-rank order
    dst = min(ranks)
    works: list[Any] = []
    if not to_one or me == dst:
        for j, r in enumerate(ranks):
            if r != me:
                works.append(dist.irecv(out[j], src=r, group=b.group))
        out[mine].copy_(inp)
    for r in ranks if not to_one else [dst]:
        if r != me:
            works.append(dist.isend(inp, dst=r, group=b.group))
    return _Works(works)


class BucketGathers:
    """Launch and wait the bucket gathers one at a time, into ``slots`` reused buffer
    pairs (send row, gathered rows): bucket ``i`` uses slot ``i % slots``, so at most
    ``slots`` gathers may be in flight or held by the caller at once.

    Args:
        receive: whether this rank needs the gathered rows of a bucket.
        use_gather: send rows to the receiving rank only (``dist.gather``; rank-0-only
            output) instead of to every rank (``all_gather_into_tensor``).
    """

    def __init__(
        self,
        buckets: list[Bucket],
        receive: Callable[[Bucket], bool],
        *,
        timeout: datetime.timedelta,
        use_gather: bool,
        slots: int = 2,
    ) -> None:
        self.buckets, self.receive, self.timeout = buckets, receive, timeout
        self.use_gather, self.slots = use_gather, slots
        self._max_row = max((b.row_bytes for b in buckets), default=0)
        self._max_world = max((b.world for b in buckets), default=0)
        self._pools: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._works: dict[int, tuple[Any, torch.Tensor | None]] = {}

    def _buffers(self, device: torch.device, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._pools:
            self._pools[device] = [
                (
                    torch.empty(self._max_row, dtype=torch.uint8, device=device),
                    torch.empty(self._max_world * self._max_row, dtype=torch.uint8, device=device),
                )
                for _ in range(self.slots)
            ]
        return self._pools[device][slot]

    def launch(self, i: int) -> None:
        """Pack this rank's row of bucket ``i`` and start its collective."""
        b = self.buckets[i]
        first = b.pieces[0].source.local()
        device = _collective_device(b, first.device)
        inp_full, out_full = self._buffers(device, i % self.slots)
        inp = inp_full[: b.row_bytes]
        direct = _direct_row(b, device)
        if direct is not None:
            inp = direct  # send the local shard itself: no packing copy
        for piece in b.pieces if direct is None else ():
            local = piece.source.local()
            itemsize = piece.source.dtype.itemsize
            lo = piece.col_lo
            hi = min(piece.col_hi, local.numel())
            if hi > lo:
                chunk = local[lo:hi].view(torch.uint8) if itemsize > 1 else local[lo:hi]
                inp[piece.col_byte : piece.col_byte + chunk.numel()].copy_(chunk.reshape(-1))
        out = out_full[: b.nbytes].view(b.world, b.row_bytes)
        try:
            if _point_to_point(b, inp):
                work = _exchange_rows(b, inp, out, self.use_gather)
            elif self.use_gather:
                dst = min(r for r in b.ranks)  # the group's receiving rank (global rank 0)
                rows = list(out.unbind(0)) if dist.get_rank() == dst else None
                work = dist.gather(inp, rows, dst=dst, group=b.group, async_op=True)
            else:
                work = dist.all_gather_into_tensor(out.view(-1), inp, group=b.group, async_op=True)
        except Exception as exc:
            raise CollectiveError(
                f"rank {dist.get_rank()}: launching the gather of bucket {i} failed: {exc}"
            ) from exc
        self._works[i] = (work, out if self.receive(b) else None)

    def wait(self, i: int) -> torch.Tensor | None:
        """Wait for bucket ``i`` (bounded by the timeout): uint8 ``[world, row_bytes]``
        where this rank receives, else None. Valid until bucket ``i + slots`` launches."""
        work, out = self._works.pop(i)
        wait_or_raise(work, self.timeout, f"gather of bucket {i}/{len(self.buckets)}")
        return out


def gather_buckets(
    buckets: list[Bucket],
    receive: Callable[[Bucket], bool],
    *,
    timeout: datetime.timedelta,
    use_gather: bool,
) -> Iterator[tuple[Bucket, torch.Tensor | None]]:
    """Gather each bucket and yield ``(bucket, rows)``: rows is uint8 ``[world,
    row_bytes]`` where this rank receives, else None. The next bucket's collective is
    in flight while the caller consumes the current one (two buffers alternate).
    Arguments as for :class:`BucketGathers`.
    """
    if not buckets:
        return
    gathers = BucketGathers(buckets, receive, timeout=timeout, use_gather=use_gather)
    gathers.launch(0)
    for i in range(len(buckets)):
        rows = gathers.wait(i)
        if i + 1 < len(buckets):
            gathers.launch(i + 1)
        yield buckets[i], rows


def receiving(plan: GatherPlan, rank0_only: bool) -> bool:
    return not rank0_only or plan.rank == 0


def my_buckets(plan: GatherPlan, bucket_mb: float, rank0_only: bool) -> list[Bucket]:
    buckets = build_buckets(plan.sources, int(bucket_mb * 2**20))
    if rank0_only:
        # Only the shard group holding global rank 0 gathers (one HSDP replica).
        buckets = [b for b in buckets if 0 in b.ranks]
    return buckets


def use_gather(buckets: list[Bucket], rank0_only: bool) -> bool:
    # gloo's gather sends each row once, to the receiver only: half the traffic and
    # no gathered buffer on the senders. NCCL has no native gather; all-gather there.
    if not rank0_only or not buckets:
        return False
    return all("gloo" in str(dist.get_backend(b.group)).lower() for b in buckets)


def receive_from_rank0(
    t: torch.Tensor | None, meta: tuple[tuple[int, ...], torch.dtype]
) -> torch.Tensor:
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
