"""The collective transport: bucket by bucket, each rank's row of every bucket gathered
to the receiving ranks, the next bucket in flight while the current one is copied out.

Host rows travel point to point on shardgather's own gloo group (see ``_dist``):
gloo's all-gather and gather receive into a fresh flat tensor of the whole gathered
bucket and copy it out (one bucket allocated, first-touched and copied per call),
whereas its receives write into our rows directly; and a failed or stuck peer then
breaks only our group, never the training's. Device rows use the model's own shard
group and ``all_gather_into_tensor`` (NCCL has no gather).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from .. import _dist
from .._dist import Call
from .._plan import Source
from .._plan.dtensor import process_group
from .buckets import Bucket


def _direct_row(b: Bucket, device: torch.device) -> torch.Tensor | None:
    """The local shard bytes when they are exactly the bucket row (one full-width chunk)."""
    if len(b.chunks) != 1:
        return None
    chunk = b.chunks[0]
    local = chunk.source.local()
    width = chunk.col_hi - chunk.col_lo
    if (
        local.device != device
        or local.numel() < chunk.col_hi
        or width * chunk.source.dtype.itemsize != b.row_bytes
    ):
        return None
    part = local[chunk.col_lo : chunk.col_hi]
    if not part.is_contiguous():
        return None
    return part.view(torch.uint8) if part.element_size() > 1 else part


def _local(src: Source) -> torch.Tensor:
    return src.local()


def pack_row(
    b: Bucket, out: torch.Tensor, row_of: Callable[[Source], torch.Tensor]
) -> torch.Tensor:
    """This rank's row of bucket ``b`` (uint8 ``[row_bytes]``), its chunks' columns of
    ``row_of(source)`` (a rank's local row) packed at their byte columns. A row shorter
    than the padded row (FSDP2's last rank) leaves its padding unwritten: no copy-out
    reads it."""
    for chunk in b.chunks:
        row = row_of(chunk.source)
        lo, hi = chunk.col_lo, min(chunk.col_hi, row.numel())
        if hi > lo:
            part = row[lo:hi].view(torch.uint8) if row.element_size() > 1 else row[lo:hi]
            out[chunk.col_byte : chunk.col_byte + part.numel()].copy_(part.reshape(-1))
    return out


class _Exchange:
    """One bucket's point-to-point messages, waited on as one."""

    def __init__(self, call: Call, works: list[tuple[Any, int]], what: str) -> None:
        self.call, self.works, self.what = call, works, what

    def wait(self) -> None:
        for work, peer in self.works:
            self.call.wait(work, self.what, peer)


class _Collective:
    def __init__(self, call: Call, work: Any, what: str) -> None:
        self.call, self.work, self.what = call, work, what

    def wait(self) -> None:
        self.call.wait(self.work, self.what)


class BucketGathers:
    """Launch and wait the bucket gathers one at a time, into ``slots`` reused buffer
    pairs (send row, gathered rows): bucket ``i`` uses slot ``i % slots``, so at most
    ``slots`` gathers may be in flight or held by the caller at once.

    Args:
        receive: whether this rank receives the gathered rows of a bucket.
        to_one: send rows to the group's first rank only (rank-0-only output) instead
            of to every rank of the group.
        group: the data group host rows travel on (None: no host buckets).
    """

    def __init__(
        self,
        call: Call,
        buckets: list[Bucket],
        receive: Callable[[Bucket], bool],
        *,
        to_one: bool,
        group: Any,
        slots: int = 2,
    ) -> None:
        self.call, self.buckets, self.receive = call, buckets, receive
        self.to_one, self.group, self.slots = to_one, group, slots
        self._max_row = max((b.row_bytes for b in buckets), default=0)
        self._max_world = max((b.world for b in buckets), default=0)
        self._pools: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._inflight: dict[int, tuple[Any, torch.Tensor | None]] = {}

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
        """Pack this rank's row of bucket ``i`` and start moving it."""
        b = self.buckets[i]
        local = b.chunks[0].source.local()
        device = local.device
        inp_full, out_full = self._buffers(device, i % self.slots)
        direct = _direct_row(b, device)
        # Send the local shard itself when it is the whole row: no packing copy.
        inp = direct if direct is not None else pack_row(b, inp_full[: b.row_bytes], _local)
        out = out_full[: b.nbytes].view(b.world, b.row_bytes)
        what = f"gather of bucket {i + 1}/{len(self.buckets)}"
        if not inp.is_cuda:
            work: Any = self._exchange_rows(b, inp, out, what)
        else:
            _dist.STATS["gathers"] += 1
            group = process_group(b.group, b.ranks)
            work = _Collective(
                self.call,
                dist.all_gather_into_tensor(out.view(-1), inp, group=group, async_op=True),
                what,
            )
        self._inflight[i] = (work, out if self.receive(b) else None)

    def _exchange_rows(
        self, b: Bucket, inp: torch.Tensor, out: torch.Tensor, what: str
    ) -> _Exchange:
        """Gather one bucket's rows by sends and receives into ``out``'s rows (rows in
        group order). Every pair of ranks posts its messages in bucket order, so they
        match in order."""
        me = self.call.rank
        ranks = list(b.ranks)
        dst = min(ranks)  # the group's receiving rank (global rank 0 when rank0_only)
        works: list[tuple[Any, int]] = []
        if not self.to_one or me == dst:
            for j, r in enumerate(ranks):
                if r != me:
                    works.append((_dist.recv(self.group, out[j], r, 0), r))
            out[b.rank].copy_(inp)
        for r in ranks if not self.to_one else [dst]:
            if r != me:
                works.append((_dist.send(self.group, inp, r, 0), r))
        return _Exchange(self.call, works, what)

    def wait(self, i: int) -> torch.Tensor | None:
        """Wait for bucket ``i`` (bounded by the call's timeout): uint8 ``[world,
        row_bytes]`` where this rank receives, else None. Valid until bucket
        ``i + slots`` launches."""
        work, out = self._inflight.pop(i)
        work.wait()
        return out


def gather_buckets(
    call: Call,
    buckets: list[Bucket],
    receive: Callable[[Bucket], bool],
    *,
    to_one: bool,
    group: Any,
) -> Iterator[tuple[Bucket, torch.Tensor | None]]:
    """Gather each bucket and yield ``(bucket, rows)``: rows is uint8 ``[world,
    row_bytes]`` where this rank receives, else None. The next bucket is in flight
    while the caller consumes the current one (two buffer pairs alternate)."""
    if not buckets:
        return
    gathers = BucketGathers(call, buckets, receive, to_one=to_one, group=group)
    gathers.launch(0)
    for i in range(len(buckets)):
        rows = gathers.wait(i)
        if i + 1 < len(buckets):
            gathers.launch(i + 1)
        yield buckets[i], rows
