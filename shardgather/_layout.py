"""Python twin of ``csrc/include/shardgather/layout.h``: the segment table and its rule.

A gathered buffer is rank-major ``[rows, row_bytes]`` (uint8). Element ``e`` of a
segment lives at ``flat = base + e``, ``row = flat // P``,
``byte = row * row_bytes + col_byte + (flat % P) * shard_elem_size``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

# Columns of the int64 segment table (must equal layout.h's SegmentCol).
BASE, ROW_NUMEL, COL_BYTE, NUMEL, FULL_INDEX, FULL_BYTE, SHARD_KIND, FULL_KIND = range(8)
SEGMENT_COLS = 8

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
    return (base + e) // row_numel


def col_of(base: int, row_numel: int, e: int) -> int:
    return (base + e) % row_numel


@dataclass(frozen=True)
class Segment:
    """One row of the segment table (see layout.h for the meaning of each field)."""

    base: int
    row_numel: int
    col_byte: int
    numel: int
    full_index: int
    full_byte: int
    shard_kind: int
    full_kind: int

    def with_dst(self, full_index: int, full_byte: int) -> Segment:
        """The same segment, delivered to another full tensor / byte offset."""
        return replace(self, full_index=full_index, full_byte=full_byte)

    def as_row(self) -> list[int]:
        return [
            self.base,
            self.row_numel,
            self.col_byte,
            self.numel,
            self.full_index,
            self.full_byte,
            self.shard_kind,
            self.full_kind,
        ]


def segment_table(segments: list[Segment]) -> torch.Tensor:
    """The int64 ``[S, 8]`` CPU tensor the compiled ops take."""
    if not segments:
        return torch.empty((0, SEGMENT_COLS), dtype=torch.int64)
    return torch.tensor([s.as_row() for s in segments], dtype=torch.int64)


def split_columns(
    seg: Segment, rows: int, col_lo: int, col_hi: int, width_byte: int
) -> list[Segment]:
    """Re-express the part of ``seg`` in columns ``[col_lo, col_hi)`` of each row as
    segments of a chunk buffer whose rows are ``col_hi - col_lo`` elements wide and
    start at byte column ``width_byte``. Used to gather a huge source in chunks.
    """
    width = col_hi - col_lo
    out: list[Segment] = []
    full_size = KIND_SIZE[seg.full_kind]
    p = seg.row_numel
    for r in range(rows):
        f0 = max(seg.base, r * p + col_lo)
        f1 = min(seg.base + seg.numel, r * p + col_hi)
        if f1 <= f0:
            continue
        out.append(
            Segment(
                base=r * width + (f0 - r * p - col_lo),
                row_numel=width,
                col_byte=width_byte,
                numel=f1 - f0,
                full_index=seg.full_index,
                full_byte=seg.full_byte + (f0 - seg.base) * full_size,
                shard_kind=seg.shard_kind,
                full_kind=seg.full_kind,
            )
        )
    return out
