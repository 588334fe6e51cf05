"""Where gathered entries go: a dict of host tensors, or files.

A sink takes bytes three ways, whatever the transport:

- ``write_whole(entry)``: an entry every rank holds in full (buffers, unsharded
  parameters), written by a receiving rank from its own copy;
- ``write_rows(rows, parts)``: parts of entries inside a carrier — a gathered bucket
  or a message from another host (uint8 ``[rows, row_bytes]``), copied out by one call
  of the copy op;
- ``target(entry)``: ``(fd, byte offset)`` where a rank pwrites its own pieces (the
  node-local transport), for sinks that live in a file every rank can open.

Setting up (``prepare`` on rank 0, whose hand-off the others ``open`` after the plan
round), flushing each rank's own writes, finishing and aborting complete the protocol
that :func:`shardgather._engine.run.gather` drives (:class:`Sink`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .. import _layout as L
from .. import _ops
from .._dist import Call
from .._plan import Entry, GatherPlan, memory_order_flat
from ..io.file_set import FileSet, OpenFiles, create, lay_out, publish, remove
from ..io.safetensors_format import pwrite_from
from . import staging
from .buckets import Part
from .node_local import Regions, region_layout, view
from .pieces import Piece, copy_whole


class Sink(Protocol):
    """What :func:`shardgather._engine.run.gather` drives: the sinks of a gather."""

    into_memory: bool  # the node-local destination is shared memory (else files)
    pieces_need_contiguous: bool  # node-local pieces must be contiguous entries
    publishes: bool  # finish() publishes a file, which one more round agrees on

    @property
    def shm_bytes(self) -> int: ...  # shared memory the node-local transport needs

    def prepare(self, call: Call, node_local: bool, memfd: bool) -> Any: ...

    def open(self, call: Call, node_local: bool, handoff: Any, writes_pieces: bool) -> None: ...

    def target(self, e: Entry) -> tuple[int, int]: ...

    def direct_fd(self, fd: int) -> int: ...

    def write_whole(self, e: Entry) -> None: ...

    def write_rows(self, rows: torch.Tensor, parts: list[Part]) -> None: ...

    def flush(self) -> None: ...

    def finish(self, call: Call) -> Any: ...

    def abort(self, call: Call) -> None: ...


@dataclass
class Handoff:
    """What rank 0 hands the other ranks of its host after making the regions."""

    names: list[str] | None = None  # what they open
    reuse: bool = False  # the regions a Gatherer holds, made for this plan: as they are


class HostDict:
    """The full state dict in host memory, on the receiving ranks.

    Node-local: views of shared-memory regions (one per dtype) that rank 0 maps and
    every rank on its host writes its pieces into. Collective: tensors allocated once
    (or ``outputs``, a previous call's, written again), pinned when asked.

    Args:
        held: regions kept open between calls (a Gatherer's): reused when they were
            made for the same plan, and left open at the end.
    """

    into_memory = True
    pieces_need_contiguous = False
    publishes = False

    def __init__(
        self,
        plan: GatherPlan,
        *,
        receives: bool,
        pin_memory: bool = False,
        outputs: dict[str, torch.Tensor] | None = None,
        held: Regions | None = None,
    ) -> None:
        self.plan, self.receives, self.pin_memory = plan, receives, pin_memory
        self.outputs = outputs
        self.held = held
        self.regions: Regions | None = None
        self.offsets: dict[str, tuple[torch.dtype, int]] = {}
        self._lent: staging.Lent | None = None
        self._slot = 0

    @property
    def shm_bytes(self) -> int:
        return sum(region_layout(self.plan)[1].values())

    # -------------------------------------------------------------- protocol

    def prepare(self, call: Call, node_local: bool, memfd: bool) -> Any:
        """Rank 0: make the destinations; returns the names others open (node-local)."""
        if not node_local:
            if self.held is not None:
                self.held.close()  # an earlier node-local call's: not written any more
            return None
        self.offsets = region_layout(self.plan)[0]
        if self.held is not None and self.held.key == self.plan.fingerprint:
            self.regions = self.held
            return Handoff(reuse=True)
        if self.held is not None:
            self.held.close()
        self.regions = self.held if self.held is not None else Regions()
        return Handoff(self.regions.create(self.plan, memfd))

    def open(self, call: Call, node_local: bool, handoff: Any, writes_pieces: bool) -> None:
        if not node_local:
            if self.held is not None:
                self.held.close()
            if self.receives and self.outputs is None:
                self.outputs = {
                    key: torch.empty_strided(
                        tuple(e.shape), e.stride, dtype=e.target_dtype, pin_memory=self.pin_memory
                    )
                    for key, e in self.plan.entries.items()
                }
            return
        self.offsets = region_layout(self.plan)[0]
        if call.rank == 0:
            return
        if handoff.reuse:
            if self.held is None or self.held.key != self.plan.fingerprint:
                raise RuntimeError("rank 0 reuses its shared regions, this rank has none open")
            self.regions = self.held
        else:
            if self.held is not None:
                self.held.close()
            self.regions = self.held if self.held is not None else Regions()
            if writes_pieces:
                self.regions.open(self.plan, handoff.names)

    def target(self, e: Entry) -> tuple[int, int]:
        assert self.regions is not None
        dt, offset = self.offsets[e.key]
        return self.regions.fds[dt], offset

    def direct_fd(self, fd: int) -> int:
        return -1  # shared memory: the page cache is the destination

    def _out(self, e: Entry) -> torch.Tensor:
        if self.regions is not None:
            return view(self.regions, self.offsets[e.key], e)
        assert self.outputs is not None
        return self.outputs[e.key]

    def write_whole(self, e: Entry) -> None:
        copy_whole(e, self._out(e))

    def write_rows(self, rows: torch.Tensor, parts: list[Part]) -> None:
        if not rows.is_cuda or all(self._out(p.entry).is_pinned() for p in parts):
            # CPU destinations from CPU rows; pinned ones, through their mapped
            # addresses, from CUDA rows.
            self._copy_out_direct(rows, parts)
            if rows.is_cuda:
                torch.cuda.current_stream(rows.device).synchronize()
            return
        self._copy_out_staged(rows, parts)

    def _copy_out_direct(self, rows: torch.Tensor, parts: list[Part]) -> None:
        fulls: list[torch.Tensor] = []
        index: dict[str, int] = {}
        segs: list[L.Segment] = []
        for p in parts:
            key = p.entry.key
            if key not in index:
                index[key] = len(fulls)
                fulls.append(memory_order_flat(self._out(p.entry)))
            segs.append(p.segment.with_dst(index[key], p.start * p.entry.target_dtype.itemsize))
        _ops.copy_out(rows, 0, L.segment_table(segs), fulls)

    def _copy_out_staged(self, rows: torch.Tensor, parts: list[Part]) -> None:
        """Device rows -> (kernel, writing a mapped pinned slab) -> pageable outputs."""
        if self._lent is None:
            self._lent = staging.Lent(2)
        sizes = [p.nbytes for p in parts]
        slab = self._lent.get(self._slot, sum(sizes) + 16 * len(parts))
        self._slot ^= 1
        segs, offsets, off = [], [], 0
        for p, n in zip(parts, sizes):
            off = (off + 15) // 16 * 16
            offsets.append(off)
            segs.append(p.segment.with_dst(0, off, full_stride=p.block.run_numel))  # packed
            off += n
        _ops.copy_out(rows, 0, L.segment_table(segs), [slab])
        torch.cuda.current_stream(rows.device).synchronize()
        for p, n, o in zip(parts, sizes, offsets):
            dt = p.entry.target_dtype
            out = memory_order_flat(self._out(p.entry))
            packed = slab[o : o + n].view(dt)
            b = p.block
            if b.contiguous:
                out[b.full : b.full + b.numel].copy_(packed)
            else:
                dst = out[b.full :].as_strided((b.count, b.run_numel), (b.strides[1], 1))
                dst.copy_(packed.view(b.count, b.run_numel))

    def flush(self) -> None:
        pass

    def finish(self, call: Call) -> dict[str, torch.Tensor] | None:
        """After the done round: rank 0's tensors (others: None)."""
        self._give_back()
        if self.regions is not None:
            result = None
            if call.rank == 0:
                self.regions.release_names()
                result = {k: self._out(e) for k, e in self.plan.entries.items()}
            if self.regions is not self.held:
                self.regions.close()  # rank 0's views keep the mapping alive
            return result
        return self.outputs if self.receives else None

    def abort(self, call: Call) -> None:
        self._give_back()
        if self.regions is not None:
            self.regions.close()

    def _give_back(self) -> None:
        if self._lent is not None:
            self._lent.give_back()
            self._lent = None


def _file_order(plan: GatherPlan) -> list[Entry]:
    # The plain model's state_dict order, whatever the wrapping: FSDP1, FSDP2 and an
    # unwrapped model write the same bytes (hashable, comparable exports), and the order
    # is the one transformers writes. Each rank still writes its pieces where they fall.
    return [plan.entries[k] for k in plan.keys if k in plan.entries]


def file_set(
    plan: GatherPlan,
    path: str | os.PathLike,
    *,
    metadata: dict[str, str] | None = None,
    stored_names: dict[str, str] | None = None,
    max_shard_size: int | None = None,
    files: dict[str, bytes] | None = None,
) -> FileSet:
    """Lay the plan out in files, in the model's key order.

    ``stored_names``: model key -> name in the file (key_map applied; identity if None).
    ``max_shard_size``: bytes per file of an HF directory at ``path`` (None: one file).
    """
    name_of = stored_names or {k: k for k in plan.keys}
    order = _file_order(plan)
    fs = lay_out(
        [(name_of[e.key], e.target_dtype, tuple(e.shape)) for e in order],
        path,
        metadata=metadata,
        max_shard_size=max_shard_size,
        files=files,
        aliases={name_of[a]: name_of[p] for a, p in plan.aliases.items()},
        total_parameters=sum(e.numel for e in plan.entries.values() if not e.is_buffer),
    )
    fs.where = {e.key: fs.where[name_of[e.key]] for e in order}
    return fs


class Files:
    """A safetensors file or a Hugging Face directory (:class:`FileSet`), written under
    a temporary name that rank 0 creates and publishes once every rank's writes are
    fsync'ed and agreed. Gathered rows are copied into a reused slab in file order and
    pwritten; non-contiguous entries (e.g. channels_last) are assembled whole first
    (safetensors stores C-order bytes)."""

    into_memory = False
    pieces_need_contiguous = True
    publishes = True
    shm_bytes = 0

    def __init__(self, fs: FileSet, *, what: str) -> None:
        self.fs, self.what = fs, what
        self.agreed = {"path": fs.final}  # the plan round checks every rank passed it
        self.tmp: str | None = None
        self.out: OpenFiles | None = None
        self._rank0_fds: list[int] = []
        self.slab = torch.empty(0, dtype=torch.uint8)
        self._lent: staging.Lent | None = None
        self.pending: dict[str, tuple[torch.Tensor, list[int]]] = {}

    def prepare(self, call: Call, node_local: bool, memfd: bool) -> Any:
        from ..errors import CheckpointError

        try:
            self.tmp, paths, self._rank0_fds = create(self.fs)
        except OSError as exc:
            raise CheckpointError(
                f"{self.what}({self.fs.final!r}): rank 0 cannot create the output beside it: "
                f"{exc}. Check that the directory exists and is writable on rank 0; nothing "
                "was written."
            ) from exc
        return (self.tmp, paths)

    def open(self, call: Call, node_local: bool, handoff: Any, writes_pieces: bool) -> None:
        self.tmp, paths = handoff
        self.out = OpenFiles(paths, self._rank0_fds if call.rank == 0 else None)

    def target(self, e: Entry) -> tuple[int, int]:
        assert self.out is not None
        i, offset = self.fs.where[e.key]
        return self.out.fd(i), offset

    def direct_fd(self, fd: int) -> int:
        """The same file opened with O_DIRECT (-1 where the filesystem refuses it)."""
        assert self.out is not None
        return self.out.direct(fd)

    def write_whole(self, e: Entry) -> None:
        full = torch.empty_strided(tuple(e.shape), e.stride, dtype=e.target_dtype)
        copy_whole(e, full)
        fd, offset = self.target(e)
        pwrite_from(fd, full.contiguous().reshape(-1).view(torch.uint8), offset)

    def write_rows(self, rows: torch.Tensor, parts: list[Part]) -> None:
        """Copy the parts into the slab laid out as the file, one copy-out, and pwrite:
        the parts of an entry that tile a range of it (its rows' blocks, every rank's
        share of a column chunk) go into one window of the slab at their file positions
        and out in one write; parts with holes between them, packed, one write per run."""
        segs: list[L.Segment] = []
        writes: list[tuple[int, int, int, int]] = []  # (fd, slab offset, file offset, bytes)
        by_entry: dict[str, list[Part]] = {}
        for p in parts:
            if not p.entry.is_contiguous:
                self._write_strided(rows, p)
                continue
            by_entry.setdefault(p.entry.key, []).append(p)
        off = 0
        for ps in by_entry.values():
            e = ps[0].entry
            size = e.target_dtype.itemsize
            fd, base = self.target(e)
            off = (off + size - 1) // size * size
            lo = min(p.block.full for p in ps)
            hi = max(p.block.full_elem(p.numel - 1) + 1 for p in ps)
            total = sum(p.numel for p in ps)
            if total == hi - lo:  # the parts tile [lo, hi): one window, one write
                for p in ps:
                    segs.append(p.segment.with_dst(0, off + (p.start - lo) * size))
                writes.append((fd, off, base + lo * size, total * size))
                off += total * size
                continue
            for p in ps:
                r = p.block.run_numel
                segs.append(p.segment.with_dst(0, off, full_stride=r))  # packed
                for f_off, p_off, n in Piece(e, p.block).writes(base):
                    writes.append((fd, off + p_off, f_off, n))
                off += p.nbytes
        slab = self._slab(off, rows.is_cuda)
        if segs:
            _ops.copy_out(rows, 0, L.segment_table(segs), [slab])
            if rows.is_cuda:
                torch.cuda.current_stream(rows.device).synchronize()
        for fd, s_off, f_off, n in coalesce(writes):
            pwrite_from(fd, slab[s_off : s_off + n], f_off)

    def _slab(self, nbytes: int, pinned: bool) -> torch.Tensor:
        if pinned:  # the kernel writes host memory through its mapped address
            if self._lent is None:
                self._lent = staging.Lent(1)
            return self._lent.get(0, nbytes)
        if self.slab.numel() < nbytes:
            self.slab = torch.empty(nbytes, dtype=torch.uint8)
        return self.slab[:nbytes]

    def _write_strided(self, rows: torch.Tensor, p: Part) -> None:
        e = p.entry
        if e.key not in self.pending:
            t = torch.empty_strided(tuple(e.shape), e.stride, dtype=e.target_dtype)
            self.pending[e.key] = (t, [e.numel])
        t, left = self.pending[e.key]
        seg = p.segment.with_dst(0, p.start * e.target_dtype.itemsize)
        dst = memory_order_flat(t)
        if rows.is_cuda:
            dst = dst.cuda(rows.device)
        _ops.copy_out(rows, 0, L.segment_table([seg]), [dst])
        if rows.is_cuda:
            memory_order_flat(t).copy_(dst)
        left[0] -= p.numel
        if left[0] == 0:
            fd, offset = self.target(e)
            pwrite_from(fd, t.contiguous().reshape(-1).view(torch.uint8), offset)
            del self.pending[e.key]

    def flush(self) -> None:
        # Every writer flushes its own writes: rank 0's fsync could run before another
        # rank's pwrite reached the page cache, and the rename would outlive the data.
        if self.out is not None:
            self.out.sync()

    def finish(self, call: Call) -> None:
        """After the done round: close; rank 0 publishes (the caller agrees on it)."""
        self._close()
        if call.rank == 0:
            assert self.tmp is not None
            try:
                publish(self.fs, self.tmp)
            except BaseException:
                remove(self.tmp)
                raise

    def abort(self, call: Call) -> None:
        self._close()
        if call.rank == 0:
            remove(self.tmp)

    def _close(self) -> None:
        if self._lent is not None:
            self._lent.give_back()
            self._lent = None
        if self.out is not None:
            self.out.close()
        elif self._rank0_fds:
            OpenFiles([], self._rank0_fds).close()
        self._rank0_fds = []


def coalesce(writes: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    out: list[tuple[int, int, int, int]] = []
    for fd, s, f, n in sorted(writes, key=lambda w: (w[0], w[2])):
        if (
            out
            and out[-1][0] == fd
            and out[-1][1] + out[-1][3] == s
            and out[-1][2] + out[-1][3] == f
        ):
            out[-1] = (fd, out[-1][1], out[-1][2], out[-1][3] + n)
        else:
            out.append((fd, s, f, n))
    return out


class StreamSink:
    """Full tensors handed to a consumer bucket by bucket (``Gatherer.iter_full_tensors``),
    into buffers reused across calls: an entry wholly inside a bucket goes to one slab
    of that bucket's outputs; one spread over several buckets to a buffer of its own,
    handed over once its last part has arrived; an entry every rank holds in full to a
    kept tensor of its own. ``owned``: fresh tensors instead (the consumer keeps them)."""

    ALIGN = 64

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.slab = torch.empty(0, dtype=torch.uint8, device=device)
        self.whole: dict[str, torch.Tensor] = {}  # unsharded entries, per key
        self.spare: list[torch.Tensor] = []  # uint8 buffers for entries spread over buckets
        self.spread: dict[str, torch.Tensor] = {}  # the ones in use, by entry
        self.owned = False
        self._dest: dict[str, torch.Tensor] = {}  # spread entries begun, not complete
        self._left: dict[str, int] = {}  # their elements still to come
        # The last bucket's entries in the slab: key -> byte offset, and the bytes used
        # (the packed verb hands the slab over as one buffer).
        self.layout: dict[str, int] = {}
        self.used = 0

    def start(self, owned: bool) -> None:
        self.owned = owned
        self._dest, self._left = {}, {}

    def handed_over(self, key: str) -> None:
        """The consumer asked for the next tensor: ``key``'s spread buffer is free."""
        if key in self.spread:
            self.spare.append(self.spread.pop(key))

    def stop(self) -> None:
        self.spare += self.spread.values()
        self.spread = {}

    def write_whole(self, e: Entry) -> torch.Tensor:
        out = self._kept(e, self.owned)
        copy_whole(e, out)
        return out

    def _kept(self, e: Entry, owned: bool) -> torch.Tensor:
        buf = None if owned else self.whole.get(e.key)
        if buf is None or buf.dtype != e.target_dtype or buf.shape != e.shape:
            buf = torch.empty_strided(
                tuple(e.shape), e.stride, dtype=e.target_dtype, device=self.device
            )
            if not owned:
                self.whole[e.key] = buf
        return buf

    def _spread_out(self, e: Entry) -> torch.Tensor:
        """A buffer for an entry spread over several buckets: fresh when owned, else the
        best-fitting spare (a spare too small is dropped first, so the spares stay as
        few as the entries in flight at once)."""
        if self.owned:
            return self._kept(e, owned=True)
        # By index: list.remove would compare tensors elementwise.
        fits = [i for i, b in enumerate(self.spare) if b.numel() >= e.nbytes]
        if fits:
            buf = self.spare.pop(min(fits, key=lambda i: self.spare[i].numel()))
        else:
            if self.spare:
                self.spare.pop(max(range(len(self.spare)), key=lambda i: self.spare[i].numel()))
            buf = torch.empty(e.nbytes, dtype=torch.uint8, device=self.device)
        self.spread[e.key] = buf
        return buf[: e.nbytes].view(e.target_dtype).as_strided(tuple(e.shape), e.stride)

    def write_rows(self, rows: torch.Tensor, parts: list[Part]) -> list[tuple[str, torch.Tensor]]:
        """Copy one bucket's parts to their destinations (one copy_out call); return the
        entries now complete."""
        if rows.device != self.device:
            rows = rows.to(self.device)
        # Entries this bucket holds all of (in one part, or one per rank's block).
        have: dict[str, int] = {}
        for p in parts:
            have[p.entry.key] = have.get(p.entry.key, 0) + p.numel
        whole = {p.entry.key: p.entry for p in parts if have[p.entry.key] == p.entry.numel}
        layout: dict[str, int] = {}
        size = 0
        if not self.owned:
            for key, e in whole.items():
                size = (size + self.ALIGN - 1) // self.ALIGN * self.ALIGN
                layout[key] = size
                size += e.nbytes
            if self.slab.numel() < size:
                self.slab = torch.empty(0, dtype=torch.uint8)  # free before allocating
                self.slab = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.layout, self.used = layout, size
        fulls: list[torch.Tensor] = []
        index: dict[str, int] = {}
        segs: list[L.Segment] = []
        done: list[tuple[str, torch.Tensor]] = []
        for p in parts:
            e = p.entry
            if e.key not in index:
                if e.key in layout:
                    raw = self.slab[layout[e.key] : layout[e.key] + e.nbytes]
                    out = raw.view(e.target_dtype).as_strided(tuple(e.shape), e.stride)
                elif e.key in whole:
                    out = self._kept(e, owned=True)
                else:
                    if e.key not in self._dest:
                        self._dest[e.key], self._left[e.key] = self._spread_out(e), e.numel
                    out = self._dest[e.key]
                index[e.key] = len(fulls)
                fulls.append(memory_order_flat(out))
                if e.key in whole:
                    done.append((e.key, out))
            segs.append(p.segment.with_dst(index[e.key], p.start * e.target_dtype.itemsize))
            if e.key in self._left:
                self._left[e.key] -= p.numel
                if self._left[e.key] == 0:
                    done.append((e.key, self._dest.pop(e.key)))
                    del self._left[e.key]
        if segs:
            _ops.copy_out(rows, 0, L.segment_table(segs), fulls)
        return done

    def close(self) -> None:
        self.slab = torch.empty(0, dtype=torch.uint8)
        self.whole, self.spare, self.spread = {}, [], {}
