"""Consolidating a torch.distributed.checkpoint (DCP) directory into one checkpoint:
``shardgather consolidate`` vs torch's own ``dcp_to_torch_save``, in the same run.

    python bench/bench_consolidate.py --size-gb 1 --world 2 [--repeats 3] [--json out.json]

The DCP directory is written once by ``world`` FSDP2 ranks (``dcp.save`` of
``get_model_state_dict``: each rank's chunks). Then, alternated (A B C, C B A, ...), each
method runs in a fresh process with the page cache dropped first (root only):

- ``python -m shardgather consolidate DIR out.safetensors`` (fsync'ed, atomic);
- the same with ``--max-shard-size 256MB`` (the Hugging Face sharded layout);
- ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save(DIR, out.pt)``.

Reported: median time, the process's peak RSS rise (kernel high-water mark); every
output is checked bit-exactly against the model once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
from _ranks import evict, run_child, run_ranks, write_json

MiB = 2**20
HERE = os.path.dirname(os.path.abspath(__file__))


def save_worker(rank: int, world: int, size_gb: float, directory: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from bench_hf_save import _sharded
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from shardgather.testing import build_gpt

    model = _sharded(build_gpt(size_gb), 2, world)
    dcp.save(get_model_state_dict(model), checkpoint_id=directory)
    return {}


# Each method in a fresh interpreter: its own peak RSS, no warm caches of the other's.
_CHILD = r"""
import json, os, sys, time
from shardgather._memory import peak_rss_rise
method, src, out = sys.argv[1:4]
import torch
with peak_rss_rise() as m:
    t = time.perf_counter()
    if method == "torch":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        dcp_to_torch_save(src, out)
    else:
        from shardgather.__main__ import main
        args = ["consolidate", src, out, "--no-progress"]
        if method == "sg-hf":
            args += ["--max-shard-size", "256MB"]
        assert main(args) == 0
    elapsed = time.perf_counter() - t
print(json.dumps({"time_s": elapsed, "peak_rss_rise": m["peak_rise"]}))
"""


def _run(method: str, src: str, out: str) -> dict:
    return run_child(_CHILD, method, src, out)


def _check(method: str, out: str, want: dict[str, torch.Tensor]) -> bool:
    from shardgather import load_file

    if method == "torch":
        got = torch.load(out, weights_only=True)
    elif method == "sg-hf":
        got = {}
        for name in os.listdir(out):
            if name.endswith(".safetensors"):
                got.update(load_file(os.path.join(out, name)))
    else:
        got = load_file(out)
    return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from shardgather.testing import build_gpt

    root = tempfile.mkdtemp(prefix="sg-consolidate-", dir=os.environ.get("SG_BENCH_DIR"))
    try:
        src = os.path.join(root, "dcp")
        run_ranks(save_worker, args.world, args.size_gb, src)
        want = build_gpt(args.size_gb).state_dict()  # the same seed as the saved model
        outs = {
            "sg": os.path.join(root, "out.safetensors"),
            "sg-hf": os.path.join(root, "out-hf"),
            "torch": os.path.join(root, "out.pt"),
        }
        labels = {
            "sg": "shardgather consolidate -> one safetensors (fsync'ed)",
            "sg-hf": "shardgather consolidate --max-shard-size 256MB -> HF directory",
            "torch": "torch dcp_to_torch_save -> one torch file",
        }
        times: dict[str, list[float]] = {m: [] for m in outs}
        rss: dict[str, list[int]] = {m: [] for m in outs}
        verified: dict[str, bool] = {}
        cold = False
        order = list(outs)
        for r in range(args.repeats + 1):  # round 0: warm-up
            for m in order if r % 2 == 0 else order[::-1]:
                if os.path.isdir(outs[m]):
                    shutil.rmtree(outs[m])
                elif os.path.exists(outs[m]):
                    os.unlink(outs[m])
                cold = evict([src])
                res = _run(m, src, outs[m])
                if r == 0:
                    verified[m] = _check(m, outs[m], want)
                    continue
                times[m].append(res["time_s"])
                rss[m].append(res["peak_rss_rise"])
        base = statistics.median(times["sg"])
        size = sum(v.numel() * v.element_size() for v in want.values()) / 2**30
        print(
            f"\n{size:.1f} GiB GPT from a {args.world}-rank FSDP2 DCP directory, median of "
            f"{args.repeats}, methods alternated, page cache dropped: {cold}"
        )
        print(f"{'method':70} time s   x sg  peak RSS rise MiB  ok")
        results = []
        for m in outs:
            t = statistics.median(times[m])
            peak = max(rss[m])
            print(f"{labels[m]:70} {t:6.3f} {t / base:6.2f} {peak / MiB:17.0f}  {verified[m]}")
            results.append(
                {
                    "method": labels[m],
                    "time_s": t,
                    "times_s": times[m],
                    "time_ratio_vs_shardgather": t / base,
                    "peak_rss_rise": peak,
                    "page_cache_dropped": cold,
                    "verified": verified[m],
                }
            )
        write_json(args.json, "bench_consolidate.py", args, results=results)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
