"""The disk's cold read floor on this machine, for reading bench_hf_load.py's numbers:
1 GiB read with the page cache dropped, by one sequential reader (64 MiB preads), by two
concurrent readers (like two ranks), and through mmap page faults (torch's readers).

    python bench/bench_read_floor.py [--size-gb 1] [--repeats 3] [--json out.json]

Methods alternate; medians.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import tempfile
import threading
import time

import numpy as np
from _ranks import drop_caches

CHUNK = 64 * 2**20


def _readers(path: str, k: int) -> None:
    """k threads, each reading its contiguous 1/k of the file (as ranks read shards)."""
    n = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)

    def run(i: int) -> None:
        buf = memoryview(bytearray(CHUNK))
        lo, hi = n * i // k, n * (i + 1) // k
        for off in range(lo, hi, CHUNK):
            os.preadv(fd, [buf[: min(CHUNK, hi - off)]], off)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    os.close(fd)


def _mmap(path: str) -> None:
    n = os.path.getsize(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), n, prot=mmap.PROT_READ) as m:
        a = np.frombuffer(m, dtype=np.uint8)
        out = np.empty(CHUNK, dtype=np.uint8)
        for off in range(0, n, CHUNK):
            part = a[off : off + CHUNK]
            out[: len(part)] = part
        del a, part


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    methods = {
        "one sequential reader": lambda p: _readers(p, 1),
        "two concurrent readers (halves)": lambda p: _readers(p, 2),
        "mmap page faults": _mmap,
    }
    with tempfile.TemporaryDirectory(dir=os.environ.get("SG_BENCH_DIR")) as d:
        path = os.path.join(d, "data.bin")
        n = int(args.size_gb * 2**30)
        with open(path, "wb") as f:
            block = os.urandom(CHUNK)
            for off in range(0, n, CHUNK):
                f.write(block[: min(CHUNK, n - off)])
            os.fsync(f.fileno())
        times: dict[str, list[float]] = {m: [] for m in methods}
        cold = False
        for r in range(args.repeats):
            for name in list(methods) if r % 2 == 0 else list(methods)[::-1]:
                cold = drop_caches()
                t = time.perf_counter()
                methods[name](path)
                times[name].append(time.perf_counter() - t)
    print(f"{args.size_gb} GiB, page cache dropped: {cold}, median of {args.repeats}")
    out = []
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:34} {med:6.3f} s  {n / med / 1e9:5.2f} GB/s  {[round(x, 3) for x in ts]}")
        out.append({"method": name, "time_s": med, "times_s": ts, "cold": cold})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size_gb": args.size_gb, "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
