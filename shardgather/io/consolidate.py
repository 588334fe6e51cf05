"""Copying stored tensors into laid-out output files, in parallel and bounded: the file
jobs (``shardgather consolidate``, a ZeRO checkpoint into a shardgather checkpoint).

Two readers by default (one on a single core), beside the writer: reads and writes
overlap, and a second read in flight keeps the device queue busy while the first
reader waits for a free buffer (bench/bench_deepspeed.py on this VM: 2.0-2.9 s with two,
3.2-4.2 s with one; earlier, on a faster-writing disk, the two were even). More
``workers`` are for sources that take parallel I/O (NVMe arrays, network filesystems)
and CPU-bound casts; each costs one 64 MiB buffer.

Threads, not processes: every step is a syscall (``copy_file_range``, ``pread``,
``pwrite``) or a cast, and all of them release the GIL, so threads keep the copies in
flight like processes would, without a process's start-up (an interpreter and torch:
~1 s and ~500 MiB each) or re-opening the source description in each.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any

import torch

from .safetensors_format import pread_into, pwrite_from
from .stored import StoredTensor

PIECE = 64 * 2**20  # bytes of one piece of work (and of a casting worker's buffer)
DEFAULT_WORKERS = min(2, os.cpu_count() or 1)


def copy_tensors(
    items: list[tuple[str, StoredTensor, torch.dtype]],
    fds: list[int],
    where: dict[str, tuple[int, int]],
    workers: int | None,
    bar: Any,
) -> None:
    """Every tensor's elements from its stored runs to its offset in the output files,
    in pieces of at most 64 MiB: ``workers`` reader threads read (and cast) pieces while
    the calling thread writes the previous ones, so the disk reads and writes at once.
    The first error stops everyone and is raised.

    A piece is read into a page-aligned buffer placed at its file offset modulo the
    block size, and its block-aligned bulk written with O_DIRECT: to the disk by DMA,
    no dirty page cache for the final fsync to write back. Heads and tails go through
    the page cache; where the filesystem refuses O_DIRECT (tmpfs), readers copy their
    pieces themselves (same dtype: file to file in the kernel, copy_file_range).
    Memory: ``workers + 1`` buffers of a piece."""
    pieces = []
    for name, t, odt in items:
        list(t.runs(0, t.numel))  # locate lazily-located chunks (DCP) before threads share t
        step = max(1, PIECE // max(t.dtype.itemsize, odt.itemsize))
        for a in range(0, t.numel, step):
            pieces.append((name, t, odt, a, min(t.numel, a + step)))
    srcs = {p: os.open(p, os.O_RDONLY) for _, t, _ in items for p in t.paths}
    for fd in srcs.values():
        # Each source is read front to back (interleaved with the others: ZeRO-3 puts
        # every parameter's slices in every rank's file): a doubled readahead window.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    direct = {i: _reopen_direct(fd) for i, fd in enumerate(fds)} if _direct_enabled() else {}
    n = max(1, min(workers or DEFAULT_WORKERS, len(pieces)))
    lock = threading.Lock()
    order = iter(pieces)
    failed = threading.Event()
    free: queue.Queue[torch.Tensor] = queue.Queue()
    ready: queue.Queue[Any] = queue.Queue()
    if any(d >= 0 for d in direct.values()):
        for _ in range(n + 1):
            free.put(_aligned(PIECE + BLOCK))

    def read() -> None:
        buf = torch.empty(0, dtype=torch.uint8)
        try:
            while not failed.is_set():
                with lock:
                    piece = next(order, None)
                if piece is None:
                    return
                name, t, odt, a, b = piece
                i, at = where[name]
                size, out_size = t.dtype.itemsize, odt.itemsize
                f0, n_out = at + a * out_size, (b - a) * out_size
                if odt != t.dtype:
                    k = (b - a) * size
                    if buf.numel() < k:
                        buf = torch.empty(k, dtype=torch.uint8)
                    _read(t, a, b, srcs, buf[:k])
                if direct.get(i, -1) >= 0 and n_out >= 2 * BLOCK:
                    bounce = _take(free, failed)
                    if bounce is None:
                        return
                    window = bounce[f0 % BLOCK : f0 % BLOCK + n_out]
                    if odt == t.dtype:
                        _read(t, a, b, srcs, window)
                    else:
                        window.copy_(buf[: (b - a) * size].view(t.dtype).to(odt).view(torch.uint8))
                    ready.put((i, window, f0, bounce))
                    continue
                if odt == t.dtype:
                    for path, offset, first, count in t.runs(a, b):
                        copy_range(srcs[path], offset, fds[i], at + first * size, count * size)
                else:
                    cast_ = buf[: (b - a) * size].view(t.dtype).to(odt)
                    pwrite_from(fds[i], cast_.view(torch.uint8), f0)
                ready.put(n_out)
        except BaseException as exc:
            failed.set()
            ready.put(exc)
        finally:
            ready.put(None)  # this reader is done

    threads = [
        threading.Thread(target=read, name=f"sg-consolidate-{r}", daemon=True) for r in range(n)
    ]
    try:
        for th in threads:
            th.start()
        running = n
        while running:
            item = ready.get()
            if item is None:
                running -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, tuple):
                i, window, f0, bounce = item
                try:
                    if not _write_direct(fds[i], direct[i], window, f0):
                        direct[i] = -1  # refused: readers copy through the page cache now
                finally:
                    free.put(bounce)
                item = window.numel()
            if bar is not None:
                bar.update(item)
    except BaseException:
        failed.set()
        raise
    finally:
        for th in threads:
            th.join()
        for fd in [*srcs.values(), *(d for d in direct.values() if d >= 0)]:
            os.close(fd)


def _take(free: queue.Queue[torch.Tensor], failed: threading.Event) -> torch.Tensor | None:
    """A free buffer, or None once the job failed (the writer stopped giving them back)."""
    while not failed.is_set():
        try:
            return free.get(timeout=0.1)
        except queue.Empty:
            continue
    return None


BLOCK = 4096  # O_DIRECT's alignment of file offsets, lengths and memory (any device's)


def _direct_enabled() -> bool:
    """``SHARDGATHER_DIRECT_IO=0`` keeps every write in the page cache (as the engine)."""
    return hasattr(os, "O_DIRECT") and os.environ.get("SHARDGATHER_DIRECT_IO", "1") != "0"


def _reopen_direct(fd: int) -> int:
    """The file behind ``fd`` opened again with O_DIRECT, or -1."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_DIRECT)
    except OSError:
        return -1


def _aligned(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + BLOCK, dtype=torch.uint8)
    start = (-raw.data_ptr()) % BLOCK
    return raw[start : start + nbytes]


def _read(t: StoredTensor, a: int, b: int, srcs: dict[str, int], out: torch.Tensor) -> None:
    size = t.dtype.itemsize
    for path, offset, first, count in t.runs(a, b):
        lo = (first - a) * size
        pread_into(srcs[path], out[lo : lo + count * size], offset)


def _write_direct(fd: int, dfd: int, window: torch.Tensor, f0: int) -> bool:
    """``window`` (placed at ``f0`` mod BLOCK in aligned memory) at file offset ``f0``:
    its aligned middle through ``dfd``, head and tail through ``fd``. False: the
    device refused O_DIRECT (everything went through ``fd``)."""
    f1 = f0 + window.numel()
    lo, hi = f0 + (-f0) % BLOCK, f1 // BLOCK * BLOCK
    if hi - lo < BLOCK:
        pwrite_from(fd, window, f0)
        return True
    try:
        pwrite_from(dfd, window[lo - f0 : hi - f0], lo)
    except OSError:
        pwrite_from(fd, window, f0)
        return False
    pwrite_from(fd, window[: lo - f0], f0)
    pwrite_from(fd, window[hi - f0 :], hi)
    return True


def copy_range(src: int, src_off: int, dst: int, dst_off: int, n: int) -> None:
    """n bytes file to file: in the kernel where it can (copy_file_range), else through
    a buffer."""
    done = 0
    while done < n:
        try:
            k = os.copy_file_range(src, dst, n - done, src_off + done, dst_off + done)
        except OSError:
            k = 0
        if k <= 0:
            buf = torch.empty(n - done, dtype=torch.uint8)
            pread_into(src, buf, src_off + done)
            pwrite_from(dst, buf, dst_off + done)
            return
        done += k
