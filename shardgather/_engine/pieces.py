"""What each rank holds of every entry, written to its final place, or packed into
messages for rank 0.

From the plan, a rank's elements of an entry are one contiguous run in its local row
and one contiguous run in the destination (FSDP1: a shard is a contiguous range of the
flat parameter; FSDP2: a shard is a contiguous dim-0 row range), so a rank's work is a
short list of pieces ``(entry, local offset, destination offset, count)``. Any rank can
compute any other rank's pieces from the plan alone.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import _layout as L
from .. import _ops
from .._plan import Entry, GatherPlan, memory_order_flat, row_of_rank
from ..io.safetensors_format import pwrite_from
from . import staging
from .buckets import Part, align

STAGING_BYTES = 16 * 2**20  # casts on the host go through a buffer of at most this


@dataclass
class Piece:
    entry: Entry
    local_elem: int  # first element in the holding rank's row
    dst_elem: int  # first element in the entry (memory order)
    numel: int


def pieces_of(
    plan: GatherPlan, participating: Callable[[int], bool], rank: int | None = None
) -> list[Piece]:
    """The contiguous runs of every gathered entry held by global ``rank`` (default:
    this process), for the sources ``participating(source index)`` selects."""
    me = plan.rank if rank is None else rank
    out: list[Piece] = []
    for e in plan.entries.values():
        src = e.source
        if src.group is None or not participating(src.index) or e.numel == 0:
            continue
        row = src.rank if me == plan.rank else row_of_rank(src, me)
        if row is None:
            continue
        p = src.row_numel
        lo = min(max(row * p - e.base, 0), e.numel)
        hi = min(max((row + 1) * p - e.base, 0), e.numel)
        if hi > lo:
            out.append(Piece(e, e.base + lo - row * p, lo, hi - lo))
    return out


class Rows:
    """Each source's local row, read once per call (``Source.local`` may rebuild a row,
    e.g. FSDP1 use_orig_params optimizer state)."""

    def __init__(self) -> None:
        self._rows: dict[int, torch.Tensor] = {}

    def of(self, entry: Entry) -> torch.Tensor:
        src = entry.source
        if id(src) not in self._rows:
            self._rows[id(src)] = src.local()
        return self._rows[id(src)]

    def piece(self, pc: Piece) -> torch.Tensor:
        return self.of(pc.entry)[pc.local_elem : pc.local_elem + pc.numel]

    def part(self, p: Part) -> torch.Tensor:
        """A part of this rank's own elements (message parts are made of them)."""
        e = p.entry
        first = e.base + p.start - e.source.rank * e.source.row_numel
        return self.of(e)[first : first + p.numel]


def write_pieces(
    pieces: list[Piece],
    target: Callable[[Entry], tuple[int, int]],
    direct: Callable[[int], int] | None = None,
) -> None:
    """pwrite each piece at ``target(entry)`` = (fd, byte offset of the entry's first
    element) + its own offset.

    CPU shards, into a file whose filesystem takes O_DIRECT (``direct(fd)``: its O_DIRECT
    descriptor, or -1): each piece goes through an aligned buffer (cast on the way, if
    asked) and its block-aligned bulk to the disk by DMA — one copy, none into the page
    cache and no dirty pages for the fsync to write back; heads and tails through the page
    cache. Otherwise same-dtype pieces go straight from the local row, casts through a
    reused buffer. CUDA shards: the copy kernel casts each chunk into one of two pinned
    slabs (writing host memory through its mapped address) while the previous chunk is
    written, so the device-to-host copy and the write overlap.
    """
    rows = Rows()
    on_device: list[tuple[Piece, torch.Tensor]] = []
    buf = torch.empty(0, dtype=torch.uint8)
    bounce: Bounce | None = None
    for pc in pieces:
        e = pc.entry
        chunk = rows.piece(pc)
        if chunk.is_cuda:
            on_device.append((pc, chunk))
            continue
        out_size = e.target_dtype.itemsize
        fd, offset = target(e)
        base = offset + pc.dst_elem * out_size
        dfd = direct(fd) if direct is not None and pc.numel * out_size >= 2 * BLOCK else -1
        done = 0
        if dfd >= 0 and direct_io_enabled():
            if bounce is None:
                bounce = Bounce(STAGING_BYTES)
            done = bounce.write(chunk, e.target_dtype, fd, dfd, base)
            if done == pc.numel:
                continue
            direct = None  # the device refused O_DIRECT: the page cache from here on
        if e.target_dtype == chunk.dtype:
            pwrite_from(fd, chunk[done:].contiguous().view(torch.uint8), base + done * out_size)
            continue
        step = max(1, STAGING_BYTES // out_size)
        for a in range(done, pc.numel, step):
            n = min(step, pc.numel - a)
            if buf.numel() < n * out_size:
                buf = torch.empty(n * out_size, dtype=torch.uint8)
            cast_into(chunk[a : a + n], e.target_dtype, buf[: n * out_size])
            pwrite_from(fd, buf[: n * out_size], base + a * out_size)
    if on_device:
        _write_from_device(on_device, target)


BLOCK = 4096  # O_DIRECT's alignment of file offsets, lengths and memory (any device's)


def direct_io_enabled() -> bool:
    """``SHARDGATHER_DIRECT_IO=0`` keeps every write in the page cache."""
    return os.environ.get("SHARDGATHER_DIRECT_IO", "1") != "0"


class Bounce:
    """A page-aligned buffer through which a chunk of elements reaches a file: placed at
    the offset congruent to its file offset (mod :data:`BLOCK`), so that its aligned
    middle can be written with O_DIRECT and only its head and tail go through the page
    cache."""

    def __init__(self, nbytes: int) -> None:
        raw = torch.empty(nbytes + 2 * BLOCK, dtype=torch.uint8)
        start = (-raw.data_ptr()) % BLOCK
        self.buf = raw[start : start + nbytes + BLOCK]
        self.capacity = nbytes

    def write(self, chunk: torch.Tensor, dtype: torch.dtype, fd: int, dfd: int, at: int) -> int:
        """``chunk`` cast to ``dtype`` at file offset ``at``. Returns how many elements
        were written: all, or up to where the device refused an O_DIRECT write."""
        size = dtype.itemsize
        step = max(1, self.capacity // size)
        for a in range(0, chunk.numel(), step):
            n = min(step, chunk.numel() - a)
            f0, f1 = at + a * size, at + (a + n) * size
            skew = f0 % BLOCK
            window = self.buf[skew : skew + f1 - f0]
            cast_into(chunk[a : a + n], dtype, window)
            lo, hi = f0 + (-f0) % BLOCK, f1 // BLOCK * BLOCK
            if hi - lo >= BLOCK:
                try:
                    pwrite_from(dfd, window[lo - f0 : hi - f0], lo)
                except OSError:
                    pwrite_from(fd, window, f0)  # this window through the page cache
                    return a + n
                pwrite_from(fd, window[: lo - f0], f0)
                pwrite_from(fd, window[hi - f0 :], hi)
            else:
                pwrite_from(fd, window, f0)
        return chunk.numel()


def _write_from_device(
    pieces: list[tuple[Piece, torch.Tensor]], target: Callable[[Entry], tuple[int, int]]
) -> None:
    jobs = []  # (chunk part, target dtype, fd, file offset)
    for pc, chunk in pieces:
        size = pc.entry.target_dtype.itemsize
        step = max(1, STAGING_BYTES // size)
        fd, offset = target(pc.entry)
        base = offset + pc.dst_elem * size
        for a in range(0, pc.numel, step):
            jobs.append((chunk[a : a + step], pc.entry.target_dtype, fd, base + a * size))
    pending: tuple[torch.Tensor, int, int, torch.cuda.Event] | None = None
    with staging.slabs(2) as slabs:
        for i, (part, dtype, fd, offset) in enumerate(jobs):
            # Slab i % 2 was last used by job i - 2, written (synchronously) before now.
            buf = slabs.get(i % 2, part.numel() * dtype.itemsize)
            cast_into(part, dtype, buf)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(part.device))  # the kernel's stream
            if pending is not None:
                pending[3].synchronize()
                pwrite_from(pending[1], pending[0], pending[2])
            pending = (buf, fd, offset, done)
        if pending is not None:
            pending[3].synchronize()
            pwrite_from(pending[1], pending[0], pending[2])


def cast_into(chunk: torch.Tensor, dtype: torch.dtype, out: torch.Tensor) -> None:
    """``out`` (uint8, ``chunk.numel()`` elements of ``dtype``) = ``chunk`` cast, by the
    copy-out kernel with one segment (bit-identical to ``Tensor.to``)."""
    n = chunk.numel()
    if n == 0:
        return
    rows = chunk.contiguous().view(torch.uint8).view(1, -1)
    seg = L.Segment(0, n, 0, n, 0, 0, L.kind_of(chunk.dtype), L.kind_of(dtype))
    _ops.copy_out(rows, 0, L.segment_table([seg]), [out])


def copy_whole(e: Entry, out: torch.Tensor) -> None:
    """An entry every rank holds in full (buffer, unmanaged or NO_SHARD param) into
    ``out`` (its shape and stride), cast to ``out``'s dtype."""
    src = e.source.local()
    flat_out = memory_order_flat(out)
    n = e.numel
    chunk = src[e.base : e.base + n]
    if chunk.device.type == "cpu" and flat_out.device.type == "cpu" and chunk.is_contiguous() and n:
        rows = (
            chunk.view(torch.uint8).view(1, -1) if chunk.element_size() > 1 else chunk.view(1, -1)
        )
        seg = L.Segment(0, n, 0, n, 0, 0, L.kind_of(chunk.dtype), L.kind_of(out.dtype))
        _ops.copy_out(rows.contiguous(), 0, L.segment_table([seg]), [flat_out])
    elif n > 0:
        flat_out.copy_(chunk)


def messages(pieces: list[Piece], message_bytes: int) -> list[list[Part]]:
    """Pack pieces in order into messages of at most ``message_bytes`` — parts of their
    entries, already in the output dtype, 16-byte aligned (a piece larger than a message
    is split). Each part's segment locates it in the message seen as one row, so the
    receiver hands a message to a sink exactly like a gathered bucket."""
    cap = max(message_bytes, 4 * 16)
    out: list[list[Part]] = []
    cur: list[Part] = []
    used = 0
    for pc in pieces:
        size = pc.entry.target_dtype.itemsize
        kind = L.kind_of(pc.entry.target_dtype)
        a = 0
        while a < pc.numel:
            room = (cap - align(used)) // size
            if room <= 0:
                out.append(cur)
                cur, used = [], 0
                continue
            n = min(room, pc.numel - a)
            seg = L.Segment(0, n, align(used), n, 0, 0, kind, kind)
            cur.append(Part(pc.entry, pc.dst_elem + a, n, seg))
            used = align(used) + n * size
            a += n
    if cur:
        out.append(cur)
    return out


def message_size(parts: list[Part]) -> int:
    return parts[-1].segment.col_byte + parts[-1].nbytes
