"""Python twin of ``csrc/include/shardgather/layout.h``: the segment table and its rule.

A gathered buffer is rank-major ``[rows, row_bytes]`` (uint8). A segment is ``numel``
elements in runs of ``run`` (a block, strided on both sides). Element ``s`` lives at
``i, j = divmod(s, run)``, ``flat = base + i * shard_stride + j``, ``row = flat // P``,
``byte = row * row_bytes + col_byte + (flat % P) * shard_elem_size``, and goes to element
``i * full_stride + j`` of the full tensor (from ``full_byte``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

# Columns of the int64 segment table (must equal layout.h's SegmentCol).
(
    BASE,
    ROW_NUMEL,
    COL_BYTE,
    NUMEL,
    FULL_INDEX,
    FULL_BYTE,
    SHARD_KIND,
    FULL_KIND,
    RUN,
    SHARD_STRIDE,
    FULL_STRIDE,
) = range(11)
SEGMENT_COLS = 11

# Element kinds (must equal layout.h's ElemKind).
RAW1, RAW2, RAW4, RAW8, RAW16, F16, BF16, F32, F64 = range(9)
_FLOAT_KINDS = {torch.float16: F16, torch.bfloat16: BF16, torch.float32: F32, torch.float64: F64}
_RAW_KINDS = {1: RAW1, 2: RAW2, 4: RAW4, 8: RAW8, 16: RAW16}
KIND_SIZE = {RAW1: 1, RAW2: 2, RAW4: 4, RAW8: 8, RAW16: 16, F16: 2, BF16: 2, F32: 4, F64: 8}
KIND_DTYPE = {F16: torch.float16, BF16: torch.bfloat16, F32: torch.float32, F64: torch.float64}


def kind_of(dtype: torch.dtype) -> int:
    """The element kind that copies ``dtype``: a float kind (castable) or raw bytes."""
    if dtype in _FLOAT_KINDS:
        return _FLOAT_KINDS[dtype]
    size = torch.empty((), dtype=dtype).element_size()
    if size not in _RAW_KINDS:
        raise ValueError(f"unsupported element size {size} of dtype {dtype}")
    return _RAW_KINDS[size]


def is_float_kind(kind: int) -> bool:
    return kind in KIND_DTYPE


def row_of(base: int, row_numel: int, e: int) -> int:
    """The row of element ``e`` of a one-run segment (FSDP1/FSDP2 dim-0)."""
    return (base + e) // row_numel


def col_of(base: int, row_numel: int, e: int) -> int:
    return (base + e) % row_numel


@dataclass(frozen=True)
class Block:
    """Elements of a full tensor that sit together on the shard side: ``numel``
    elements in runs of ``run`` (0: one run), run ``i`` starting at flat shard position
    ``shard + i * shard_stride`` (the rank-major concatenation of rows: row = flat // P)
    and at element ``full + i * full_stride`` of the full tensor (its memory order).
    The plan describes every entry as blocks; a segment is a block placed in a buffer."""

    shard: int
    full: int
    numel: int
    run: int = 0
    shard_stride: int = 0
    full_stride: int = 0

    @property
    def run_numel(self) -> int:
        return self.run if 0 < self.run < self.numel else max(self.numel, 1)

    @property
    def count(self) -> int:
        return self.numel // self.run_numel if self.numel else 0

    @property
    def strides(self) -> tuple[int, int]:
        """(shard, full) distance between run starts (the run itself when one run)."""
        r = self.run_numel
        return (self.shard_stride, self.full_stride) if r < self.numel else (r, r)

    @property
    def contiguous(self) -> bool:
        return self.count <= 1

    def flat(self, s: int) -> int:
        """Flat shard position of element ``s``."""
        r = self.run_numel
        return self.shard + (s // r) * self.strides[0] + s % r

    def full_elem(self, s: int) -> int:
        r = self.run_numel
        return self.full + (s // r) * self.strides[1] + s % r

    def elem_at_or_after(self, f: int) -> int:
        """The first element whose flat shard position is >= ``f`` (numel if none)."""
        d = f - self.shard
        if d <= 0:
            return 0
        r, ss = self.run_numel, self.strides[0]
        i, j = divmod(d, ss)
        return min(self.numel, (i + 1) * r if j >= r else i * r + j)

    def sub(self, s0: int, s1: int) -> list[Block]:
        """Elements ``[s0, s1)`` as blocks of whole runs: a partial first run, the
        whole runs, a partial last run."""
        r = self.run_numel
        ss, fs = self.strides
        out: list[Block] = []
        while s0 < s1:
            j = s0 % r
            if j or s1 - s0 < r:  # a partial run: contiguous on both sides
                n = min(r - j, s1 - s0)
                out.append(Block(self.flat(s0), self.full_elem(s0), n, n, n, n))
            else:
                n = (s1 - s0) // r * r
                strided = n > r
                out.append(
                    Block(
                        self.flat(s0),
                        self.full_elem(s0),
                        n,
                        r,
                        ss if strided else r,
                        fs if strided else r,
                    )
                )
            s0 += n
        return out

    def clip(self, lo: int, hi: int) -> list[Block]:
        """The elements whose flat shard position is in ``[lo, hi)`` (one row's, or a
        column window's), as blocks."""
        return self.sub(self.elem_at_or_after(lo), self.elem_at_or_after(hi))

    def runs(self) -> list[tuple[int, int, int]]:
        """``(flat shard position, full element, numel)`` of every run."""
        r = self.run_numel
        ss, fs = self.strides
        return [(self.shard + i * ss, self.full + i * fs, r) for i in range(self.count)]


@dataclass(frozen=True)
class Segment:
    """One row of the segment table (see layout.h for the meaning of each field).
    ``run=0`` means one contiguous run (``numel``); strides then do not matter."""

    base: int
    row_numel: int
    col_byte: int
    numel: int
    full_index: int
    full_byte: int
    shard_kind: int
    full_kind: int
    run: int = 0
    shard_stride: int = 0
    full_stride: int = 0

    @staticmethod
    def of(
        block: Block,
        row_numel: int,
        col_byte: int,
        shard_kind: int,
        full_kind: int,
        full_index: int = 0,
        full_byte: int = 0,
    ) -> Segment:
        """``block`` in a buffer whose rows are ``row_numel`` wide from ``col_byte``,
        delivered to ``full_index`` with element 0 at ``full_byte``."""
        ss, fs = block.strides
        r = block.run_numel
        return Segment(
            block.shard, row_numel, col_byte, block.numel, full_index, full_byte,
            shard_kind, full_kind, r, ss, fs,
        )  # fmt: skip

    @property
    def block(self) -> Block:
        """The segment's layout (full element 0 at ``full_byte``)."""
        return Block(self.base, 0, self.numel, self.run, self.shard_stride, self.full_stride)

    def with_dst(self, full_index: int, full_byte: int, full_stride: int | None = None) -> Segment:
        """The same segment, delivered to another full tensor / byte offset (and, for a
        strided segment, another full-side pitch: e.g. packed, ``full_stride=run``)."""
        out = replace(self, full_index=full_index, full_byte=full_byte)
        return out if full_stride is None else replace(out, full_stride=full_stride)

    def as_row(self) -> list[int]:
        b = self.block
        ss, fs = b.strides
        return [
            self.base,
            self.row_numel,
            self.col_byte,
            self.numel,
            self.full_index,
            self.full_byte,
            self.shard_kind,
            self.full_kind,
            b.run_numel,
            ss,
            fs,
        ]


def segment_table(segments: list[Segment]) -> torch.Tensor:
    """The int64 ``[S, 11]`` CPU tensor the compiled ops take."""
    if not segments:
        return torch.empty((0, SEGMENT_COLS), dtype=torch.int64)
    return torch.tensor([s.as_row() for s in segments], dtype=torch.int64)


def in_columns(block: Block, rows: int, row_numel: int, col_lo: int, col_hi: int) -> list[Block]:
    """The part of ``block`` in columns ``[col_lo, col_hi)`` of each of ``rows`` rows of
    ``row_numel``, re-expressed in a chunk buffer whose rows are ``col_hi - col_lo``
    elements wide (full positions unchanged). Used to gather a huge source in chunks."""
    width = col_hi - col_lo
    out: list[Block] = []
    for r in range(rows):
        for c in block.clip(r * row_numel + col_lo, r * row_numel + col_hi):
            # In one row: flat - r*P - col_lo is the column in the chunk.
            out.append(replace(c, shard=r * width + c.shard - r * row_numel - col_lo))
    return out


def split_columns(
    seg: Segment, rows: int, col_lo: int, col_hi: int, width_byte: int
) -> list[Segment]:
    """:func:`in_columns` for a segment: its part in columns ``[col_lo, col_hi)``, as
    segments of a chunk buffer whose rows start at byte column ``width_byte``."""
    size = KIND_SIZE[seg.full_kind]
    return [
        Segment.of(
            b,
            col_hi - col_lo,
            width_byte,
            seg.shard_kind,
            seg.full_kind,
            seg.full_index,
            seg.full_byte + b.full * size,
        )
        for b in in_columns(seg.block, rows, seg.row_numel, col_lo, col_hi)
    ]
