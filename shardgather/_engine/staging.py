"""Pinned host slabs: the staging between CUDA kernels and host writes, reused.

Pinning costs milliseconds per MiB (it maps and locks pages), so slabs are kept
between calls — but only up to a cap (``SHARDGATHER_PINNED_CACHE_MB``, default 512):
a call lends the slabs it needs (:func:`slabs`) and gives them back at its end, when
the pool keeps the largest ones that fit under the cap and frees the rest.
:func:`release` frees every kept slab (``shardgather.release_staging()``). CUDA only:
on the CPU the copy kernels write straight into their destinations.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_LOCK = threading.Lock()
_KEPT: list[torch.Tensor] = []  # free slabs, largest first


def cache_limit() -> int:
    """Bytes of pinned slabs kept between calls."""
    return int(float(os.environ.get("SHARDGATHER_PINNED_CACHE_MB", "512")) * 2**20)


def kept_bytes() -> int:
    with _LOCK:
        return sum(t.numel() for t in _KEPT)


class Lent:
    """The slabs one call holds: ``get(i, nbytes)`` is slot ``i``, grown as needed (a
    grown slot's old slab goes back to the pool at the end, like the others)."""

    def __init__(self, n: int) -> None:
        self._slots: list[torch.Tensor | None] = [None] * n
        self._spare: list[torch.Tensor] = []

    def get(self, i: int, nbytes: int) -> torch.Tensor:
        cur = self._slots[i]
        if cur is None or cur.numel() < nbytes:
            if cur is not None:
                self._spare.append(cur)
            cur = _take(max(nbytes, 1))
            self._slots[i] = cur
        return cur[:nbytes]

    def give_back(self) -> None:
        with _LOCK:
            _KEPT.extend(t for t in self._slots if t is not None)
            _KEPT.extend(self._spare)
            _KEPT.sort(key=lambda t: -t.numel())
            budget = cache_limit()
            kept: list[torch.Tensor] = []
            for t in _KEPT:
                if t.numel() <= budget:
                    kept.append(t)
                    budget -= t.numel()
            _KEPT[:] = kept  # the rest is freed (cudaFreeHost, through the allocator)
        self._slots, self._spare = [], []


def _take(nbytes: int) -> torch.Tensor:
    """The smallest kept slab of at least ``nbytes``, or a new one."""
    with _LOCK:
        fits = [i for i, t in enumerate(_KEPT) if t.numel() >= nbytes]
        if fits:
            return _KEPT.pop(min(fits, key=lambda i: _KEPT[i].numel()))
    return _allocate(nbytes)


def _allocate(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


@contextmanager
def slabs(n: int) -> Iterator[Lent]:
    """Lend ``n`` slab slots for the duration of the block (the caller synchronises
    every use of a slab before the block ends)."""
    lent = Lent(n)
    try:
        yield lent
    finally:
        lent.give_back()


def release() -> None:
    """Free every kept pinned slab."""
    with _LOCK:
        _KEPT.clear()
