"""Peak host RSS of a block of code, from the kernel's high-water mark.

The HWM is reset through /proc/self/clear_refs where allowed (else a 2 ms sampler of
/proc/self/statm stands in), after gc + malloc_trim so freed-but-cached glibc chunks
do not hide the rise. The node's shared memory (/dev/shm) is sampled every 20 ms and
at the end.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _shmem() -> int:
    """System-wide shared memory (tmpfs, /dev/shm) in bytes: output that lives there is
    memory too, though no process's RSS shows it until touched."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def trim() -> None:
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@contextmanager
def peak_rss_rise() -> Iterator[dict]:
    """``with peak_rss_rise() as m: ...`` then ``m["peak_rise"]``: this process's peak
    RSS rise, and ``m["shm_rise"]``: the node's peak shared-memory rise (bytes)."""
    trim()
    base = _rss()
    shm_base = _shmem()
    hwm_ok = _reset_hwm()
    # With the kernel's high-water mark only /dev/shm needs sampling, and slowly: a 2 ms
    # poller in every rank measurably slows a page-fault-bound copy on a 2-vCPU machine.
    interval = 0.02 if hwm_ok else 0.002
    peak = [base]
    shm_peak = [shm_base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            shm_peak[0] = max(shm_peak[0], _shmem())
            time.sleep(interval)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    out: dict = {}
    try:
        yield out
    finally:
        stop.set()
        t.join()
        top = max(peak[0], _rss(), _hwm() if hwm_ok else 0)
        out["peak_rise"] = top - base
        out["base_rss"] = base
        out["shm_rise"] = max(shm_peak[0], _shmem()) - shm_base
