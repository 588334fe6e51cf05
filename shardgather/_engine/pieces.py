"""What each rank holds of every entry, written to its final place, or packed into
messages for rank 0.

From the plan, a rank's elements of an entry are a few blocks of its local row (FSDP1,
FSDP2 dim-0: one contiguous run, in its row and in the destination; a DTensor's local
tensor under row-wise TP: equal runs strided in the destination), so a rank's work is
a short list of pieces ``(entry, block)`` — the block's ``shard`` is where it starts in
the rank's row, its ``full`` where in the entry. Any rank can compute any other rank's
pieces from the plan alone.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .. import _layout as L
from .. import _ops
from .._plan import Block, Entry, GatherPlan, memory_order_flat, row_blocks, row_of_rank
from ..io.safetensors_format import pwrite_from
from . import staging
from .buckets import Part, align

STAGING_BYTES = 16 * 2**20  # casts on the host go through a buffer of at most this


@dataclass
class Piece:
    entry: Entry
    block: Block  # shard: first element in the holding rank's row; full: in the entry

    @property
    def local_elem(self) -> int:
        return self.block.shard

    @property
    def dst_elem(self) -> int:
        return self.block.full

    @property
    def numel(self) -> int:
        return self.block.numel

    @property
    def nbytes(self) -> int:
        return self.numel * self.entry.target_dtype.itemsize

    def writes(self, at: int) -> list[tuple[int, int, int]]:
        """Where its elements go in a file whose entry starts at byte ``at``:
        ``(file offset, offset in the piece packed, bytes)`` per run."""
        size = self.entry.target_dtype.itemsize
        r = self.block.run_numel
        fs = self.block.strides[1]
        return [
            (at + (self.block.full + i * fs) * size, i * r * size, r * size)
            for i in range(self.block.count)
        ]


def pieces_of(
    plan: GatherPlan, participating: Callable[[int], bool], rank: int | None = None
) -> list[Piece]:
    """The blocks of every gathered entry held by global ``rank`` (default: this
    process), for the sources ``participating(source index)`` selects."""
    me = plan.rank if rank is None else rank
    out: list[Piece] = []
    for e in plan.entries.values():
        src = e.source
        if src.group is None or not participating(src.index) or e.numel == 0:
            continue
        row = src.rank if me == plan.rank else row_of_rank(src, me)
        if row is None:
            continue
        start = row * src.row_numel
        for b in row_blocks(e, row):
            out.append(Piece(e, replace(b, shard=b.shard - start)))
    return out


class Rows:
    """The local row of the source being read, built once while its pieces go by
    (``Source.local`` may build a row: FSDP1 use_orig_params optimizer state, merged
    adapters). One row is held at a time — pieces come in plan order, a source's
    together — so built rows never add up to a rank's whole shard."""

    def __init__(self) -> None:
        self._src: int | None = None
        self._row: torch.Tensor | None = None

    def of(self, entry: Entry) -> torch.Tensor:
        src = entry.source
        if self._src != id(src) or self._row is None:
            self._row = None  # the previous row goes before the next one is built
            self._row, self._src = src.local(), id(src)
        return self._row

    def piece(self, pc: Piece) -> torch.Tensor:
        """A contiguous piece's elements (a view of the row)."""
        return self.of(pc.entry)[pc.local_elem : pc.local_elem + pc.numel]

    def held(self, entry: Entry, held: Block) -> torch.Tensor:
        """The elements of a block of this rank's row: a 1-D view when contiguous,
        else ``[count, run]`` (strided)."""
        row = self.of(entry)
        if held.contiguous:
            return row[held.shard : held.shard + held.numel]
        return row[held.shard :].as_strided((held.count, held.run_numel), (held.strides[0], 1))

    def pack(self, entry: Entry, held: Block, dtype: torch.dtype, out: torch.Tensor) -> None:
        """The elements of ``held`` (a block of this rank's row of ``entry``'s source),
        cast to ``dtype``, packed into ``out`` (uint8) by one copy-out."""
        pack_into(self.of(entry), held, dtype, out)


def pack_into(row: torch.Tensor, held: Block, dtype: torch.dtype, out: torch.Tensor) -> None:
    """``out`` (uint8, ``held.numel`` elements of ``dtype``) = the elements of block
    ``held`` of the 1-D ``row``, packed run after run, cast by the copy-out kernel
    (bit-identical to ``Tensor.to``)."""
    if held.numel == 0:
        return
    if held.contiguous:
        cast_into(row[held.shard : held.shard + held.numel], dtype, out)
        return
    n = row.numel()
    rows = row.contiguous().view(torch.uint8).view(1, -1)
    packed = replace(held, full=0, full_stride=held.run_numel)
    seg = L.Segment.of(packed, n, 0, L.kind_of(row.dtype), L.kind_of(dtype))
    _ops.copy_out(rows, 0, L.segment_table([seg]), [out])


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
    strided: list[Piece] = []
    buf = torch.empty(0, dtype=torch.uint8)
    bounce: Bounce | None = None
    for pc in pieces:
        e = pc.entry
        if not pc.block.contiguous:
            strided.append(pc)
            continue
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
    if strided:
        _write_runs(strided, rows, target)


def _write_runs(
    pieces: list[Piece], rows: Rows, target: Callable[[Entry], tuple[int, int]]
) -> None:
    """Strided pieces (a DTensor's block under row-wise TP): whole runs at a time are
    packed (and cast) by one copy-out into a buffer — pinned for CUDA rows, which the
    kernel writes through its mapped address — and each run pwritten to its place."""
    buf = torch.empty(0, dtype=torch.uint8)
    with staging.slabs(1) as slabs:
        for pc in pieces:
            b, size = pc.block, pc.entry.target_dtype.itemsize
            row = rows.of(pc.entry)
            fd, at = target(pc.entry)
            r = b.run_numel
            step = max(1, STAGING_BYTES // (r * size)) * r
            for a in range(0, b.numel, step):
                part = Piece(pc.entry, b.sub(a, min(b.numel, a + step))[0])
                n = part.nbytes
                if row.is_cuda:
                    out = slabs.get(0, n)
                    pack_into(row, part.block, pc.entry.target_dtype, out)
                    torch.cuda.current_stream(row.device).synchronize()
                else:
                    if buf.numel() < n:
                        buf = torch.empty(n, dtype=torch.uint8)
                    out = buf[:n]
                    pack_into(row, part.block, pc.entry.target_dtype, out)
                for f_off, p_off, nbytes in part.writes(at):
                    pwrite_from(fd, out[p_off : p_off + nbytes], f_off)


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
    entries, already in the output dtype, packed run after run, 16-byte aligned (a piece
    larger than a message is split). Each part's segment locates it in the message seen
    as one row, so the receiver hands a message to a sink exactly like a gathered
    bucket; its ``held`` says where the sender holds it."""
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
            for held in pc.block.sub(a, a + n):
                r, fs = held.run_numel, held.strides[1]
                packed = Block(0, held.full, held.numel, r, r, fs)
                seg = L.Segment.of(packed, held.numel, align(used), kind, kind)
                cur.append(Part(pc.entry, packed, seg, held))
                used = align(used) + held.numel * size
            a += n
    if cur:
        out.append(cur)
    return out


def message_size(parts: list[Part]) -> int:
    return parts[-1].segment.col_byte + parts[-1].nbytes
