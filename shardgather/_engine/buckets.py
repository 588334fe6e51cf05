"""Buckets and parts: how the collective transport groups sources into collectives,
and where each entry's elements sit in a gathered bucket. Pure functions of the plan
(every rank computes the same list, so collectives match), testable from metadata.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch.distributed as dist

from .. import _layout as L
from .._plan import Block, Entry, GatherPlan, Source, blocks_of

ALIGN = 16  # byte alignment of each chunk's columns in a bucket row (16-byte vectors)


def align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass
class Chunk:
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
    """Chunks of sources sharing one group, moved by one collective: gathered, it is
    uint8 ``[world, row_bytes]``, one row per rank of the group (rank-major)."""

    group: dist.ProcessGroup
    world: int
    rank: int  # this process's row in the group
    ranks: tuple[int, ...]  # global ranks of the group, in row order
    row_bytes: int
    chunks: list[Chunk]

    @property
    def nbytes(self) -> int:
        return self.world * self.row_bytes


def build_buckets(
    sources: list[Source],
    bucket_bytes: int,
    columns: dict[int, list[tuple[int, int]]] | None = None,
) -> list[Bucket]:
    """Pack gathered sources, in plan order, into buckets of at most ``bucket_bytes``
    gathered bytes; a source too big for one bucket is split into column chunks.
    ``columns``: only these column ranges of each source's rows (a subset plan)."""
    buckets: list[Bucket] = []
    cur: Bucket | None = None
    for src in sources:
        if src.group is None or src.row_numel == 0:
            continue
        row_cap = max(ALIGN, bucket_bytes // src.world // ALIGN * ALIGN)
        itemsize = src.dtype.itemsize
        for lo, hi in columns[src.index] if columns is not None else [(0, src.row_numel)]:
            cur = _pack_columns(buckets, cur, src, lo, hi, row_cap, itemsize)
    return buckets


def _pack_columns(
    buckets: list[Bucket],
    cur: Bucket | None,
    src: Source,
    col: int,
    end: int,
    row_cap: int,
    itemsize: int,
) -> Bucket | None:
    """Columns ``[col, end)`` of ``src`` into the current bucket and new ones; returns
    the bucket being filled."""
    while col < end:
        # Sources of one bucket share their rows: the same ranks in the same order.
        if cur is None or cur.ranks != src.group_ranks or cur.row_bytes >= row_cap:
            cur = Bucket(src.group, src.world, src.rank, src.group_ranks, 0, [])
            buckets.append(cur)
        room = (row_cap - cur.row_bytes) // itemsize
        if room <= 0:
            cur = None
            continue
        take = min(room, end - col)
        cur.chunks.append(Chunk(src, col, col + take, cur.row_bytes))
        cur.row_bytes = align(cur.row_bytes + take * itemsize)
        col += take
    return cur


def my_buckets(
    plan: GatherPlan, bucket_mb: float, rank0_only: bool, only: Collection[int] | None = None
) -> list[Bucket]:
    """The buckets this call moves: all of them, or (``rank0_only``) those of the shard
    groups holding global rank 0 (one HSDP replica); ``only``: of these sources alone
    (one phase of the plan: no bucket holds sources of two phases)."""
    sources = plan.sources if only is None else [s for s in plan.sources if s.index in only]
    buckets = build_buckets(sources, int(bucket_mb * 2**20), plan.columns)
    if rank0_only:
        buckets = [b for b in buckets if 0 in b.ranks]
    return buckets


@dataclass
class Part:
    """Elements of an entry inside a carrier — a gathered bucket, or a message — and
    the segment that locates them there (its destination fields ``full_index`` /
    ``full_byte`` are filled in by the sink). ``block`` says which elements: from full
    element ``block.full`` (the entry's memory order), runs of ``block.run_numel`` every
    ``block.strides[1]`` elements (one run: a contiguous range). ``held``: where the
    sending rank holds them in its own row (message parts only)."""

    entry: Entry
    block: Block
    segment: L.Segment
    held: Block | None = None

    @property
    def start(self) -> int:
        return self.block.full

    @property
    def numel(self) -> int:
        return self.block.numel

    @property
    def nbytes(self) -> int:
        return self.numel * self.entry.target_dtype.itemsize


def bucket_parts(bucket: Bucket, by_source: dict[int, list[Entry]]) -> list[Part]:
    """Where every entry element in ``bucket`` sits in the gathered ``[world, row_bytes]``."""
    parts: list[Part] = []
    for chunk in bucket.chunks:
        src = chunk.source
        kind = L.kind_of(src.dtype)
        for e in by_source.get(src.index, []):
            out_kind = L.kind_of(e.target_dtype)
            for block in blocks_of(e):
                if chunk.whole:
                    pieces = [block]
                    width = src.row_numel
                else:
                    width = chunk.col_hi - chunk.col_lo
                    pieces = L.in_columns(
                        block, bucket.world, src.row_numel, chunk.col_lo, chunk.col_hi
                    )
                for b in pieces:
                    seg = L.Segment.of(b, width, chunk.col_byte, kind, out_kind)
                    parts.append(Part(e, b, seg))
    return parts
