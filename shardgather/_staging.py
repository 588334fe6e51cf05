"""Pinned host staging slabs, allocated once and reused across calls.

Pinned allocation costs milliseconds per MiB (it maps and locks pages), so a slab
is cached per (slot, minimum size) and only grows. CUDA only: on the CPU the copy
kernels write straight into their destinations.
"""

from __future__ import annotations

import torch

_SLABS: dict[int, torch.Tensor] = {}


def slab(slot: int, nbytes: int) -> torch.Tensor:
    """A pinned uint8 buffer of at least ``nbytes`` for ``slot`` (reused; not zeroed)."""
    cur = _SLABS.get(slot)
    if cur is None or cur.numel() < nbytes:
        _SLABS.pop(slot, None)
        cur = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
        _SLABS[slot] = cur
    return cur[:nbytes]


def release() -> None:
    """Free every cached slab (e.g. before a memory-hungry phase)."""
    _SLABS.clear()
