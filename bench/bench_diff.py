"""The weight-sync delta's compare on its own: ``diff_update`` over one chunk.

    OMP_NUM_THREADS=1 python bench/bench_diff.py [--mb 32] [--changed 0.02]

A float32 source (``--mb`` MiB) against its bf16 reference as last sent, after each
repeat bumps ``--changed`` of the elements by one bf16 step; reports the first call
(fresh pages) and the median of the rest, checking the reference equals the cast.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from shardgather import _ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=32.0)
    ap.add_argument("--changed", type=float, default=0.02)
    ap.add_argument("--repeats", type=int, default=12)
    args = ap.parse_args()
    n = int(args.mb * 2**20) // 4
    g = torch.Generator().manual_seed(0)
    src = torch.randn(n, generator=g)
    ref = src.to(torch.bfloat16)
    cap = n * 2 // 6  # the sender's break-even room (int32 position + bf16 value)
    pos, val = torch.empty(cap, dtype=torch.int32), torch.empty(cap, dtype=torch.bfloat16)
    times, k = [], 0
    for _ in range(args.repeats):
        idx = torch.randint(0, n, (int(n * args.changed),), generator=g)
        src.view(torch.int32).index_add_(0, idx, torch.full_like(idx, 1 << 16, dtype=torch.int32))
        t0 = time.perf_counter()
        k = _ops.diff_update(src, ref, pos, val, 0)
        times.append(time.perf_counter() - t0)
        assert torch.equal(ref, src.to(torch.bfloat16))
    print(
        f"diff_update {n / 2**20:.0f} M float32 -> bf16, {args.changed:.1%} changed ({k} found): "
        f"first {times[0] * 1e3:.2f} ms, median {statistics.median(times[1:]) * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
