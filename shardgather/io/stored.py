"""Where a checkpoint's tensor lives: its dtype and shape, and the extents of files that
hold its row-major elements. A safetensors tensor is one extent; a DCP tensor is one
extent per saved chunk (one per row block of each saving rank, typically).

Loaders read any element range through :meth:`StoredTensor.runs`, so each rank preads
exactly the bytes of its own shard, from whichever files hold them.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..errors import CheckpointError


@dataclass(frozen=True)
class Extent:
    """``count`` elements, from element ``first`` of the tensor (row-major), stored
    contiguously in ``path`` from byte ``offset``."""

    path: str
    first: int
    count: int
    offset: int


@dataclass
class StoredTensor:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    extents: list[Extent]  # sorted by first, covering 0..numel exactly
    _firsts: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.extents.sort(key=lambda x: x.first)
        pos = 0
        for x in self.extents:
            if x.first != pos or x.count <= 0:
                what = "overlap" if x.first < pos else "leave a gap"
                raise CheckpointError(
                    f"{self.key!r}: the stored chunks {what} at element {min(pos, x.first)} of "
                    f"{self.numel}: the checkpoint is damaged or incomplete"
                )
            pos += x.count
        if pos != self.numel:
            raise CheckpointError(
                f"{self.key!r}: the stored chunks hold {pos} of its {self.numel} elements: the "
                "checkpoint is incomplete"
            )
        self._firsts = [x.first for x in self.extents]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def paths(self) -> list[str]:
        return sorted({x.path for x in self.extents})

    def runs(self, lo: int, hi: int) -> Iterator[tuple[str, int, int, int]]:
        """Elements ``lo:hi`` as (path, byte offset, first element, element count) runs,
        in element order."""
        i = max(0, bisect.bisect_right(self._firsts, lo) - 1)
        size = self.dtype.itemsize
        while lo < hi and i < len(self.extents):
            x = self.extents[i]
            end = min(hi, x.first + x.count)
            if end > lo:
                yield x.path, x.offset + (lo - x.first) * size, lo, end - lo
                lo = end
            i += 1


def one_extent(key: str, path: str, dtype: torch.dtype, shape: tuple[int, ...], begin: int):
    """A tensor stored whole from byte ``begin`` of ``path`` (safetensors)."""
    n = 1
    for d in shape:
        n *= d
    extents = [Extent(os.fspath(path), 0, n, begin)] if n else []
    return StoredTensor(key, dtype, tuple(shape), extents)
