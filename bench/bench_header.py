"""What validating a safetensors header costs: shardgather's read_header (its own checks
plus the safetensors library's) vs the library's safe_open alone, on files with many
tensors (a 70B model has ~700 per shard file; HF's largest have a few thousand).

python3 bench/bench_header.py [--tensors 1000 10000] [--repeats 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shardgather.io.safetensors_format import read_header


def _time(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tensors", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for n in args.tensors:
            path = os.path.join(d, f"{n}.safetensors")
            save_file({f"layers.{i}.weight": torch.zeros(4, 4) for i in range(n)}, path)

            def library(path: str = path) -> None:
                with safe_open(path, framework="pt"):
                    pass

            ours = _time(lambda path=path: read_header(path), args.repeats)
            lib = _time(library, args.repeats)
            rows.append({"tensors": n, "read_header_ms": ours * 1e3, "safe_open_ms": lib * 1e3})
            print(
                f"{n:6d} tensors: read_header {ours * 1e3:7.2f} ms, safe_open alone {lib * 1e3:7.2f} ms"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python3 bench/bench_header.py", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
