"""Save while training runs: the node-local transport, split in time.

A save's data phase is each rank writing its own pieces to their final offsets in the
file. Here it is cut in two: at call time each rank copies its own pieces aside (a
**snapshot**: one memcpy of its shard, cast if asked, into a reused staging buffer;
on CUDA, the copy kernel writes pinned staging on a side stream that the training's
stream then waits for) — and that is all training waits for. A background thread of
each rank then pwrites the snapshot where it belongs and fsyncs: no collective runs in
the background (a collective from a second thread would race the training loop's own).
The done round, the publication (rename) and its round run when the caller asks
(:meth:`AsyncSave.wait`), or at the next save of the same model.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .._dist import Call
from .._options import Options
from .._plan import Entry, GatherPlan
from .._progress import Progress
from ..errors import CollectiveError, ShardGatherError
from ..io.safetensors_format import pwrite_from
from . import node_local
from .pieces import (
    BLOCK,
    Piece,
    Rows,
    copy_whole,
    direct_io_enabled,
    pack_into,
    pieces_of,
    write_pieces,
)
from .run import Route, move, route
from .sinks import Files, coalesce

# Staging kept between saves, per (model, what): a reused buffer is already faulted in
# (or pinned), so the next snapshot is a plain memcpy.
_KEPT: dict[tuple[int, str], torch.Tensor] = {}


def release() -> None:
    """Free every kept snapshot buffer."""
    _KEPT.clear()


def _buffer(owner: int, what: str, nbytes: int, pinned: bool) -> torch.Tensor:
    cur = _KEPT.pop((owner, what), None)
    if cur is None or cur.numel() < nbytes or cur.is_pinned() != pinned:
        cur = None  # freed before the new one is made
        cur = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)
    return cur


class Snapshot:
    """This rank's bytes of one save, copied aside now and written later.

    Each run is placed in the buffer at an offset congruent to its file offset modulo
    :data:`BLOCK` (a page-aligned buffer, at most a block of padding per run), so the
    background writes its block-aligned middle with O_DIRECT — the disk reads the
    buffer by DMA: no copy into the page cache, next to no CPU taken from training —
    and only the unaligned head and tail of each run through the page cache.

    ``writes``: ``(fd, file offset, buffer offset, bytes)``; pieces beyond ``cap`` bytes
    are not snapshotted but written at once (the call then blocks for them)."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.writes: list[tuple[int, int, int, int]] = []
        self.ready: torch.cuda.Event | None = None  # CUDA: the snapshot copies are done
        self.direct: Callable[[int], int] = lambda fd: -1

    def take(
        self,
        whole: list[Entry],
        pieces: list[Piece],
        target: Callable[[Entry], tuple[int, int]],
        buffer: Callable[[int, bool], torch.Tensor],
        cap: int | None,
        direct: Callable[[int], int] | None = None,
    ) -> None:
        rows = Rows()
        self.direct = direct or self.direct
        # Where each run goes: (entry or piece, fd, file offset, bytes, buffer offset).
        plan: list[tuple[Any, int, int, int, int]] = []
        off = 0
        for item in [*whole, *pieces]:
            e = item if isinstance(item, Entry) else item.entry
            fd, at = target(e)
            if not isinstance(item, Entry):
                at += item.dst_elem * e.target_dtype.itemsize
            n = e.nbytes if isinstance(item, Entry) else item.nbytes
            if isinstance(item, Entry) or item.block.contiguous:
                off += (at - off) % BLOCK  # congruent with the file offset
            plan.append((item, fd, at, n, off))
            off += n
        room = off if cap is None else min(off, cap)
        on_cuda = any(rows.of(pc.entry).is_cuda for pc in pieces)
        raw = buffer(room + BLOCK, on_cuda)
        start = (-raw.data_ptr()) % BLOCK
        self.buffer = raw[start : start + room]
        side = torch.cuda.Stream() if on_cuda else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())  # the shards as they are now
        for item, fd, at, n, boff in plan:
            if boff + n > room:  # over the cap: goes to the file now
                if isinstance(item, Entry):
                    pwrite_from(fd, _whole_bytes(item), at)
                else:
                    write_pieces([item], target)
                continue
            out = self.buffer[boff : boff + n]
            if isinstance(item, Entry):  # small (buffers, unsharded params)
                out.copy_(_whole_bytes(item))
                self.writes.append((fd, at, boff, n))
                continue
            row = rows.of(item.entry)
            if side is not None and row.is_cuda:
                with torch.cuda.stream(side):
                    pack_into(row, item.block, item.entry.target_dtype, out)
            else:
                pack_into(row, item.block, item.entry.target_dtype, out)
            # A strided piece (row-wise TP) lands run by run; at = its first run's offset.
            start = at - item.dst_elem * item.entry.target_dtype.itemsize
            for f_off, p_off, nbytes in item.writes(start):
                self.writes.append((fd, f_off, boff + p_off, nbytes))
        if side is not None:
            self.ready = torch.cuda.Event()
            self.ready.record(side)
            # Training's next kernels (the optimizer step) wait for the copies to have
            # read the shards; the host does not.
            torch.cuda.current_stream().wait_event(self.ready)

    def write(
        self, bytes_per_s: float | None = None, on_bytes: Callable[[int], None] | None = None
    ) -> None:
        """The background part: every snapshotted byte to its place in the file, at
        most ``bytes_per_s`` (None: as fast as the disk takes them); ``on_bytes(n)``
        after each write (progress)."""
        count = on_bytes or (lambda n: None)
        if self.ready is not None:
            self.ready.synchronize()
        pace = _Pace(bytes_per_s)
        runs = coalesce([(fd, off, at, n) for fd, at, off, n in self.writes])
        for fd, off, at, n in runs:  # (fd, buffer offset, file offset, bytes)
            lo = at + (-at) % BLOCK  # the block-aligned middle [lo, hi)
            hi = (at + n) // BLOCK * BLOCK
            dfd = self.direct(fd) if hi - lo >= BLOCK and direct_io_enabled() else -1
            if dfd >= 0:
                try:
                    for a in range(lo, hi, pace.step):
                        b = min(hi, a + pace.step)
                        pwrite_from(dfd, self.buffer[off + a - at : off + b - at], a)
                        pace.wrote(b - a)
                        count(b - a)
                except OSError:  # the device wants a larger alignment: page cache it is
                    self.direct = lambda fd: -1
                    dfd = -1
            if dfd < 0:
                for a in range(at, at + n, pace.step):
                    b = min(at + n, a + pace.step)
                    pwrite_from(fd, self.buffer[off + a - at : off + b - at], a)
                    pace.wrote(b - a)
                    count(b - a)
                continue
            pwrite_from(fd, self.buffer[off : off + lo - at], at)
            pwrite_from(fd, self.buffer[off + hi - at : off + n], hi)
            count(n - (hi - lo))

    @property
    def nbytes(self) -> int:
        return sum(n for *_, n in self.writes)


class _Pace:
    """Writes of at most ``step`` bytes, slept between so as not to exceed a rate."""

    def __init__(self, bytes_per_s: float | None) -> None:
        self.rate = bytes_per_s
        self.step = 1 << 62 if bytes_per_s is None else 8 * 2**20
        self.start = time.monotonic()
        self.done = 0

    def wrote(self, n: int) -> None:
        if self.rate is None:
            return
        self.done += n
        ahead = self.start + self.done / self.rate - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)


def _whole_bytes(e: Entry) -> torch.Tensor:
    """An entry every rank holds whole, in the output dtype, C-order bytes."""
    full = torch.empty_strided(tuple(e.shape), e.stride, dtype=e.target_dtype)
    copy_whole(e, full)
    return full.contiguous().reshape(-1).view(torch.uint8)


class Later:
    """One gather into files whose data phase was snapshotted: ``write`` is the
    background part (pwrites and fsync of this rank's own bytes); the done round and
    the sink's publication are :meth:`AsyncSave.wait`'s."""

    def __init__(
        self, call: Call, sink: Files, snapshot: Snapshot | None, bytes_per_s: float | None = None
    ) -> None:
        self.call, self.sink, self.snapshot = call, sink, snapshot
        self.bytes_per_s = bytes_per_s

    def write(self, on_bytes: Callable[[int], None] | None = None) -> None:
        if self.snapshot is not None:
            self.snapshot.write(self.bytes_per_s, on_bytes)
            self.sink.flush()


def gather_later(
    call: Call,
    plan: GatherPlan,
    sink: Files,
    opts: Options,
    buffer: Callable[[int, bool], torch.Tensor],
) -> Later:
    """Route ``plan`` into ``sink`` and snapshot this rank's part of the data phase.
    Where the node-local transport cannot run (ranks on other hosts without a shared
    filesystem, non-contiguous sharded entries, ``transport="collective"``) the data
    moves now, synchronously (warned once): only the publication is left for later."""
    try:
        way: Route = route(call, plan, sink, opts)
        if not way.local or way.remote:
            node_local.warn_once(
                "shardgather: blocking=False needs the node-local transport on every writing "
                "rank (one host, or shared_filesystem=True, and contiguous entries); this "
                "save wrote its data now"
            )
            move(call, plan, sink, opts, way, Progress(call, False, 0, ""))
            return Later(call, sink, None)
        snap = Snapshot()
        whole = [e for e in plan.entries.values() if e.source.group is None] if way.receives else []
        mine = pieces_of(plan, way.participating(plan)) if way.writes_pieces else []
        snap.take(whole, mine, sink.target, buffer, opts.snapshot_cap, sink.direct_fd)
        return Later(call, sink, snap, opts.write_rate)
    except BaseException as exc:
        call.latch(exc)  # before the cleanup: a peer must find our error, not its effect
        sink.abort(call)
        raise


class AsyncSave:
    """A save running in the background (``save_full_state_dict(..., blocking=False)``,
    ``save_checkpoint(..., blocking=False)``): every rank copied its own bytes aside
    at call time; a thread of its own writes and fsyncs them.

    Call :meth:`wait` on every rank (it agrees that every rank's writes succeeded and
    publishes the output atomically), use it as a context manager (``with
    sg.save_checkpoint(..., blocking=False): ...`` waits at the end of the block), or let
    the next save of the same model do it. A save never waited for is not published:
    at interpreter exit or garbage collection it warns and removes its temporaries.
    """

    def __init__(
        self,
        call: Call,
        laters: list[Later],
        *,
        background: list[Callable[[], None]] = (),  # type: ignore[assignment]
        publish: Callable[[], None] | None = None,
        abort: Callable[[], None] | None = None,
        owner: int = 0,
        keep: list[tuple[tuple[int, str], torch.Tensor]] | None = None,
        path: str | os.PathLike = "",
        progress: Progress | None = None,
    ) -> None:
        self._call, self._laters = call, laters
        self.path = os.path.abspath(os.fspath(path)) if path else ""
        # progress=True: the writer thread counts what it writes (rank 0 on the bar,
        # the others to the job's counter), then rank 0 watches the others; wait()
        # ends the bar at the total once every rank's writes are agreed.
        self._progress = progress
        if progress is not None:
            progress.counters()
        count = progress.update if progress is not None else None
        self._background = [functools.partial(la.write, count) for la in laters]
        self._background += list(background)
        if progress is not None:
            self._background.append(self._progress_written)
        self._publish, self._abort = publish, abort
        self._keep = keep or []
        self._owner = owner
        self._error: BaseException | None = None
        self._outcome: BaseException | None = None
        self._finished = False
        self._discarded = False
        # What must wait for the writer thread: closing the files it writes through (a
        # closed descriptor's number is reused by the next open — the thread would write
        # into that file) and handing its buffer to the next save.
        self._lock = threading.Lock()
        self._writing = True
        self._after_writes: list[Callable[[], None]] = []
        self._thread = threading.Thread(
            target=self._write, name=f"shardgather {call.what}", daemon=True
        )
        self._thread.start()
        _PENDING.add(self)

    def __repr__(self) -> str:
        if not self._finished:
            state = "writing" if self._thread.is_alive() else "written, not yet waited for"
            if self._error is not None:
                state = f"failed on this rank ({type(self._error).__name__})"
        elif self._outcome is not None or self._error is not None:
            state = "failed"
        elif self._discarded:
            state = "discarded (never waited for)"
        else:
            state = "published"
        size = self.snapshot_bytes / 2**20
        return (
            f"<AsyncSave {self._call.what} -> {self.path or '?'}: {state}, {size:.1f} MiB snapshot>"
        )

    def __enter__(self) -> AsyncSave:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            self.wait()
        else:  # the block's own error is the one to see; the save still ends here
            with contextlib.suppress(Exception):
                self.wait()
        return False

    def __del__(self) -> None:
        # Reached only once the writer thread ended (it holds this handle) and the
        # model is gone (its in-flight entry holds it too).
        if not getattr(self, "_finished", True):
            self._discard("it was garbage-collected", join_s=0)

    def _discard(self, why: str, join_s: float) -> None:
        """Never waited for: say so, publish nothing, remove the temporaries (rank 0
        created them; every rank closes its files)."""
        if self._finished:
            return
        shown = repr(self)
        self._finished = self._discarded = True
        warnings.warn(
            f"{shown} was never waited for ({why}): it is discarded, nothing was "
            "published and its temporary files are removed. Call .wait() on every rank "
            "after a blocking=False save (or use `with ...:`).",
            RuntimeWarning,
            stacklevel=2,
        )
        self._thread.join(join_s)
        call = self._call

        def abort() -> None:
            for later in self._laters:
                later.sink.abort(call)
            if self._abort is not None:
                self._abort()

        self._when_written(abort)
        self._when_written(self._close_progress)
        _IN_FLIGHT.pop(self._owner, None)

    def _progress_written(self) -> None:
        assert self._progress is not None
        self._progress.report(last=True)
        if self._call.rank == 0:
            self._progress.watch_others()

    def _close_progress(self) -> None:
        if self._progress is not None:
            self._progress.close()

    def _write(self) -> None:
        try:
            for step in self._background:
                step()
        except BaseException as exc:  # surfaced by wait() on every rank
            self._error = exc
        finally:
            with self._lock:
                self._writing = False
                then, self._after_writes = self._after_writes, []
            for fn in then:
                fn()

    def _when_written(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` now if the writer thread has ended, else when it ends."""
        with self._lock:
            if self._writing:
                self._after_writes.append(fn)
                return
        fn()

    def done(self) -> bool:
        """Whether this rank's background writes have finished (no agreement: the
        other ranks may still be writing; :meth:`wait` agrees)."""
        return not self._thread.is_alive()

    @property
    def snapshot_bytes(self) -> int:
        """Bytes this rank copied aside at call time."""
        return sum(la.snapshot.nbytes for la in self._laters if la.snapshot is not None)

    def wait(self, timeout: datetime.timedelta | None = None) -> None:
        """Finish the save on every rank: wait for this rank's writes, agree that every
        rank's succeeded, publish — each wait bounded by ``timeout`` (default the
        save's). A writer that outlives it keeps its files open until it ends.
        Collective: every rank calls it. A second call returns (or raises the same
        error) at once.

        Raises:
            ShardGatherError: a rank's background write failed (a full disk...), it
                died, or did not finish in time — on every rank. Nothing is published
                (no temporary left, the previous output intact); the next save works.
        """
        if self._finished:
            if self._outcome is not None:
                raise self._outcome
            return
        self._finished = True
        limit = timeout or self._call.timeout
        call = self._call
        call.timeout = limit  # the agreement's waits too: wait(timeout) is a bound
        try:
            with call:
                self._thread.join(limit.total_seconds())
                if self._thread.is_alive():
                    raise CollectiveError(
                        f"{call.what}: this rank's background writes did not finish within {limit}"
                    )
                if self._error is not None:
                    raise self._error
                call.round("done")
                for later in self._laters:
                    later.sink.finish(call)
                if self._publish is not None and call.rank == 0:
                    self._publish()
                call.round("published")
                if self._progress is not None:
                    self._progress.done()
        except BaseException as exc:
            self._outcome = exc if isinstance(exc, ShardGatherError) else None

            def abort() -> None:  # nothing published: temporaries go, the previous stays
                for later in self._laters:
                    later.sink.abort(call)
                if self._abort is not None:
                    self._abort()

            self._when_written(abort)  # a writer still running keeps its files open
            raise
        finally:
            _IN_FLIGHT.pop(self._owner, None)
            self._when_written(self._keep_buffers)
            self._when_written(self._close_progress)  # the writer may still touch it

    def _keep_buffers(self) -> None:
        for key, buf in self._keep:
            _KEPT[key] = buf  # for the next snapshot of this model


# One save in flight per model: id(model) -> its pending save.
_IN_FLIGHT: dict[int, AsyncSave] = {}
# Every save not yet waited for, whoever holds it (for the exit warning).
_PENDING: weakref.WeakSet[AsyncSave] = weakref.WeakSet()


@atexit.register
def _discard_pending() -> None:
    """At exit, a save never waited for is discarded with a warning, its temporaries
    removed: publishing needs every rank's agreement, which a process leaving cannot
    get (the others may be gone, the process group destroyed). Its writer gets up to
    30 s to end, so its files can be closed before they are removed."""
    for save in list(_PENDING):
        if not save._finished:
            save._discard("the interpreter is exiting", join_s=30)


def settle(model: Any, in_flight: str) -> None:
    """Before a save of ``model``: finish the one still in flight (``"wait"``, every
    rank, collectively), or refuse (``"error"``)."""
    pending = _IN_FLIGHT.get(id(model))
    if pending is None:
        return
    if in_flight == "error":
        raise ShardGatherError(
            "a background save of this model is still in flight: call its wait() first, "
            'or pass in_flight="wait"'
        )
    pending.wait()


def start(model: Any, save: AsyncSave) -> AsyncSave:
    """Record ``save`` as ``model``'s save in flight (one at a time)."""
    _IN_FLIGHT[id(model)] = save
    weakref.finalize(model, _IN_FLIGHT.pop, id(model), None)
    return save


def buffer_for(
    model: Any, what: str, keep: list[tuple[tuple[int, str], torch.Tensor]], reuse: bool
) -> Callable[[int, bool], torch.Tensor]:
    """A snapshot buffer maker for ``model``'s ``what`` (model, optim): the kept one when
    it fits (``reuse``); the buffer is kept again when the save is done."""

    def make(nbytes: int, pinned: bool) -> torch.Tensor:
        key = (id(model), what)
        buf = (
            _buffer(key[0], what, nbytes, pinned)
            if reuse
            else torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)
        )
        if reuse:
            keep.append((key, buf))
        return buf

    return make
