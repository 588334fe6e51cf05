"""What each rank holds of every output entry, and writing it to its final place.

From the plan, a rank's elements of an entry are one contiguous run in its local
shard and one contiguous run in the destination (FSDP1: a shard is a contiguous
range of the flat parameter; FSDP2: a shard is a contiguous dim-0 row range), so a
rank's work is a short list of (local offset, destination offset, count) pieces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import _layout as L
from . import _ops
from ._plan import Entry, GatherPlan, memory_order_flat
from .io.safetensors_format import pwrite_from

_STAGING_BYTES = 16 * 2**20


@dataclass
class Piece:
    entry: Entry
    local_elem: int  # first element in this rank's local row
    dst_elem: int  # first element in the entry (memory order)
    numel: int


def pieces_of(
    plan: GatherPlan, participating: Callable[[int], bool], rank: int | None = None
) -> list[Piece]:
    """The contiguous runs of every gathered entry held by global ``rank`` (default:
    this process). Any rank can compute any other rank's pieces from the plan."""
    me = plan.rank if rank is None else rank
    out: list[Piece] = []
    for e in plan.entries.values():
        src = e.source
        if src.group is None or not participating(src.index) or e.numel == 0:
            continue
        if me == plan.rank:
            row = src.rank
        elif me in src.group_ranks:
            row = dist.get_group_rank(src.group, me)
        else:
            continue
        p = src.row_numel
        lo = min(max(row * p - e.base, 0), e.numel)
        hi = min(max((row + 1) * p - e.base, 0), e.numel)
        if hi > lo:
            out.append(Piece(e, e.base + lo - row * p, lo, hi - lo))
    return out


def local_chunk(pc: Piece, rows: dict[int, torch.Tensor]) -> torch.Tensor:
    """The piece's elements in this rank's local row; ``rows`` caches each source's
    ``local()`` (it may rebuild a row, e.g. FSDP1 use_orig_params optimizer state)."""
    src = pc.entry.source
    if id(src) not in rows:
        rows[id(src)] = src.local()
    return rows[id(src)][pc.local_elem : pc.local_elem + pc.numel]


def write_pieces(fd: int, pieces: list[Piece], offset_of: Callable[[Entry], int]) -> None:
    """pwrite each piece at ``offset_of(entry) + dst_elem * itemsize``.

    CPU shards: same-dtype pieces go straight from the local shard, casts through a
    reused staging buffer. CUDA shards: the copy-out kernel casts each chunk into one
    of two pinned slabs (writing host memory through its mapped address) while the
    previous chunk is written, so the device-to-host copy and the write overlap.
    """
    rows: dict[int, torch.Tensor] = {}
    on_device: list[tuple[Piece, torch.Tensor]] = []
    staging = torch.empty(0, dtype=torch.uint8)
    for pc in pieces:
        e = pc.entry
        chunk = local_chunk(pc, rows)
        if chunk.is_cuda:
            on_device.append((pc, chunk))
            continue
        out_size = e.target_dtype.itemsize
        base = offset_of(e) + pc.dst_elem * out_size
        if e.target_dtype == chunk.dtype:
            pwrite_from(fd, chunk.contiguous().view(torch.uint8), base)
            continue
        step = max(1, _STAGING_BYTES // out_size)
        for a in range(0, pc.numel, step):
            n = min(step, pc.numel - a)
            if staging.numel() < n * out_size:
                staging = torch.empty(n * out_size, dtype=torch.uint8)
            cast_into(chunk[a : a + n], e.target_dtype, staging[: n * out_size])
            pwrite_from(fd, staging[: n * out_size], base + a * out_size)
    if on_device:
        _write_from_device(fd, on_device, offset_of)


def _write_from_device(
    fd: int, pieces: list[tuple[Piece, torch.Tensor]], offset_of: Callable[[Entry], int]
) -> None:
    from . import _staging

    jobs = []  # (chunk part, target dtype, file offset)
    for pc, chunk in pieces:
        size = pc.entry.target_dtype.itemsize
        step = max(1, _STAGING_BYTES // size)
        base = offset_of(pc.entry) + pc.dst_elem * size
        for a in range(0, pc.numel, step):
            part = chunk[a : a + step]
            jobs.append((part, pc.entry.target_dtype, base + a * size))
    pending: tuple[torch.Tensor, int, torch.cuda.Event] | None = None
    for i, (part, dtype, offset) in enumerate(jobs):
        # Slot i % 2 was last used by job i - 2, written (synchronously) before now.
        buf = _staging.slab(2 + i % 2, part.numel() * dtype.itemsize)
        cast_into(part, dtype, buf)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(part.device))  # the kernel's stream
        if pending is not None:
            pending[2].synchronize()
            pwrite_from(fd, pending[0], pending[1])
        pending = (buf, offset, done)
    if pending is not None:
        pending[2].synchronize()
        pwrite_from(fd, pending[0], pending[1])


def cast_into(chunk: torch.Tensor, dtype: torch.dtype, out: torch.Tensor) -> None:
    """``out`` (uint8, ``chunk.numel()`` elements of ``dtype``) = ``chunk`` cast, by the
    copy-out kernel with one segment (bit-identical to ``Tensor.to``)."""
    n = chunk.numel()
    if n == 0:
        return
    rows = chunk.contiguous().view(torch.uint8).view(1, -1)
    seg = L.Segment(0, n, 0, n, 0, 0, L.kind_of(chunk.dtype), L.kind_of(dtype))
    _ops.copy_out(rows, 0, L.segment_table([seg]), [out])


def copy_local(src: torch.Tensor, e: Any, out: torch.Tensor) -> None:
    """A tensor every rank holds in full (buffer, unmanaged or NO_SHARD param)."""
    flat_out = memory_order_flat(out)
    n = e.numel
    chunk = src[e.base : e.base + n]
    if chunk.device.type == "cpu" and chunk.is_contiguous() and n > 0:
        rows = (
            chunk.view(torch.uint8).view(1, -1) if chunk.element_size() > 1 else chunk.view(1, -1)
        )
        seg = L.Segment(0, n, 0, n, 0, 0, L.kind_of(chunk.dtype), L.kind_of(out.dtype))
        _ops.copy_out(rows.contiguous(), 0, L.segment_table([seg]), [flat_out])
    elif n > 0:
        flat_out.copy_(chunk)
