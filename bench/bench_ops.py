"""Op-level bench: copy_out / copy_in GB/s vs what FSDP does today, per element size.

    python bench/bench_ops.py [--device cpu|cuda] [--mb 256] [--world 8] [--json out.json]

Layouts: "fsdp1" (params back to back in one flat buffer, rows of the gathered
[world, P] buffer cut across params) and "fsdp2" (each param its own padded column
block). Baselines: torch.split + copy_ per param (FSDP1's unflatten + offload copy),
torch.ops.fsdp.split_with_sizes_copy + unpad copy (FSDP2's copy-out), and the pure
torch reference (element-wise; run on a smaller size). On CUDA also: copy_out writing
pinned host memory directly vs to device then one D2H copy, and the pinned-copy peak.
GB/s counts output bytes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
from pathlib import Path

import torch

from shardgather import _layout as L
from shardgather import _reference

ops = torch.ops.shardgather


def _numels(total: int) -> list[int]:
    """Transformer-like parameter sizes (matrices, vectors), about ``total`` elements."""
    d = 1024
    pattern = [3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    out: list[int] = []
    while sum(out) < total:
        out.extend(pattern)
    return out


def layout(
    kind: str,
    world: int,
    numels: list[int],
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    device: str,
):
    size = dtype.itemsize
    if kind == "fsdp1":
        total = sum(numels)
        p = math.ceil(total / world)
        gathered = torch.randn(world * p, device=device).to(dtype)
        segs, base = [], 0
        for i, n in enumerate(numels):
            segs.append(L.Segment(base, p, 0, n, i, 0, L.kind_of(dtype), L.kind_of(out_dtype)))
            base += n
        rows = gathered.view(torch.uint8).view(world, -1)
        return rows, L.segment_table(segs), {"p": p}
    cols, segs, col = [], [], 0
    for i, n in enumerate(numels):
        p = math.ceil(n / world)
        segs.append(L.Segment(0, p, col * size, n, i, 0, L.kind_of(dtype), L.kind_of(out_dtype)))
        cols.append(p)
        col += p
    gathered = torch.randn(world * col, device=device).to(dtype)
    return gathered.view(torch.uint8).view(world, -1), L.segment_table(segs), {"cols": cols}


def timeit(fn, device: str, repeats: int = 5) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def run_case(
    kind: str, world: int, mb: float, dt: torch.dtype, odt: torch.dtype, device: str
) -> dict:
    numels = _numels(int(mb * 2**20 / dt.itemsize))
    rows, table, info = layout(kind, world, numels, dt, odt, device)
    outs = [torch.empty(n, dtype=odt, device=device) for n in numels]
    out_bytes = sum(numels) * odt.itemsize
    res: dict = {
        "layout": kind,
        "dtype": str(dt),
        "out_dtype": str(odt),
        "out_mb": out_bytes / 2**20,
    }
    res["shardgather copy_out"] = timeit(lambda: ops.copy_out(rows, 0, table, outs), device)
    typed = rows.view(-1).view(dt)
    if kind == "fsdp1":

        def split_copy() -> None:
            for o, v in zip(outs, torch.split(typed[: sum(numels)], numels)):
                o.copy_(v)

        res["torch split + copy_"] = timeit(split_copy, device)
    else:
        cols = info["cols"]
        padded = [torch.empty(world, c, dtype=dt, device=device) for c in cols]

        def fsdp2_copy_out() -> None:
            torch.ops.fsdp.split_with_sizes_copy(typed.view(world, -1), cols, dim=1, out=padded)
            for o, pb, n in zip(outs, padded, numels):
                o.copy_(pb.view(-1)[:n])  # FSDP2 then narrows the padding off

        try:
            # Importing FSDP2's collectives registers torch.ops.fsdp.split_with_sizes_copy.
            importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_collectives")
            res["torch split_with_sizes_copy + unpad"] = timeit(fsdp2_copy_out, device)
        except (AttributeError, ImportError, RuntimeError):
            pass
    # copy_in: every rank's row back (the load path)
    shard_rows = torch.zeros_like(rows)
    res["shardgather copy_in"] = timeit(lambda: ops.copy_in(outs, table, shard_rows, 0), device)
    if device == "cuda":
        pinned = [torch.empty(n, dtype=odt, pin_memory=True) for n in numels]
        res["shardgather copy_out -> pinned (mapped)"] = timeit(
            lambda: ops.copy_out(rows, 0, table, pinned), device
        )
        slab = torch.empty(out_bytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(out_bytes, dtype=torch.uint8, device=device)

        def to_dev_then_d2h() -> None:
            ops.copy_out(
                rows, 0, table, [dev.view(odt)[o_off : o_off + n] for o_off, n in _offsets(numels)]
            )
            slab.copy_(dev, non_blocking=True)

        res["shardgather copy_out -> device + D2H"] = timeit(to_dev_then_d2h, device)
        res["pinned D2H memcpy (peak)"] = timeit(lambda: slab.copy_(dev, non_blocking=True), device)
    gbs = {
        k: out_bytes / v / 1e9
        for k, v in res.items()
        if isinstance(v, float) and "MB" not in k and k not in ("out_mb",)
    }
    res["gb_per_s"] = gbs
    return res


def _offsets(numels: list[int]):
    off = 0
    for n in numels:
        yield off, n
        off += n


def reference_gbs(device: str) -> float:
    numels = _numels(2**20)  # ~4 MB: the reference is element-wise
    rows, table, _ = layout("fsdp1", 8, numels, torch.float32, torch.float32, "cpu")
    outs = [torch.empty(n) for n in numels]
    t = timeit(lambda: _reference.copy_out(rows, 0, table, outs), "cpu", repeats=2)
    return sum(numels) * 4 / t / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--mb", type=float, default=256)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cases = [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.uint8, torch.uint8),
        (torch.float64, torch.float64),
        (torch.float32, torch.bfloat16),
    ]
    rows = []
    for kind in ("fsdp1", "fsdp2"):
        for dt, odt in cases:
            rows.append(run_case(kind, args.world, args.mb, dt, odt, args.device))
    print(
        f"device {args.device}, world {args.world}, ~{args.mb:.0f} MB per case, GB/s of output "
        f"(best of 5), torch threads {torch.get_num_threads()}"
    )
    for r in rows:
        name = f"{r['layout']} {r['dtype'].replace('torch.', '')}->{r['out_dtype'].replace('torch.', '')}"
        print(f"  {name:24} " + "  ".join(f"{k}: {v:6.2f}" for k, v in r["gb_per_s"].items()))
    ref = reference_gbs(args.device)
    print(f"  pure-torch reference copy_out (fsdp1 f32, 4 MB): {ref:.3f} GB/s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {
                    "command": "python " + " ".join(sys.argv),
                    "torch": torch.__version__,
                    "rows": rows,
                    "reference_gb_per_s": ref,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
