"""Loading a sharded Hugging Face directory into an FSDP2 model: shardgather vs torch's
own HF path (``dcp.load`` with ``HuggingFaceStorageReader`` + ``set_model_state_dict``).

    python bench/bench_hf_load.py --size-gb 1 --world 2 [--repeats 3] [--shard-mb 256] [--json out.json]

The directory (index + shard files, tied embedding stored once) is written by
``huggingface_hub.save_torch_state_dict``, the library ``save_pretrained`` uses. Each
timed run starts with the page cache dropped (``sync; echo 3 > /proc/sys/vm/drop_caches``,
root only: otherwise reported as warm), methods alternate (A B A B ...), and every result
is checked bit-exactly against the model the files came from. Reported: median time, the
peak RSS rise of every rank (kernel high-water mark).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _ranks import run_ranks

from shardgather._memory import peak_rss_rise, trim
from shardgather.testing import build_gpt

MiB = 2**20


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def worker(rank: int, world: int, args: argparse.Namespace, directory: str) -> dict:
    """One rank: both methods, alternated, each verified."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import shardgather as sg

    model = build_gpt(args.size_gb)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    want = build_gpt(args.size_gb).state_dict() if rank == 0 else None

    def ours() -> None:
        sg.load_full_state_dict(model, directory)

    def torch_hf() -> None:
        sd = get_model_state_dict(model)
        # The tied lm_head is not in the files (stored once, as HF does).
        dcp.load(
            sd,
            storage_reader=HuggingFaceStorageReader(directory),
            planner=DefaultLoadPlanner(allow_partial_load=True),
        )
        set_model_state_dict(model, sd)

    methods = {
        "load: shardgather <- HF directory": ours,
        "load: torch dcp.load(HuggingFaceStorageReader) + set_model_state_dict": torch_hf,
    }
    stats = {n: {"times": [], "rss": [], "verified": None, "cold": []} for n in methods}
    order = list(methods)
    for rep in range(args.repeats + 1):
        for name in order if rep % 2 == 0 else order[::-1]:
            with torch.no_grad():
                for p in model.parameters():
                    p.to_local().zero_()
            cold = [False]
            if rank == 0:
                cold[0] = _drop_caches()
            dist.broadcast_object_list(cold, src=0)
            trim()
            dist.barrier()
            with peak_rss_rise() as mem:
                t0 = time.perf_counter()
                methods[name]()
                dist.barrier()
                dt = time.perf_counter() - t0
            got = sg.full_state_dict(model)
            if rank == 0:
                ok = all(torch.equal(got[k], want[k]) for k in want)
                stats[name]["verified"] = ok and stats[name]["verified"] is not False
            del got
            if rep:  # the first round is the warm-up
                stats[name]["times"].append(dt)
                stats[name]["rss"].append(mem["peak_rise"])
                stats[name]["cold"].append(cold[0])
    return {"stats": stats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shard-mb", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from huggingface_hub import save_torch_state_dict

    with tempfile.TemporaryDirectory(prefix="sg-bench-hf-") as tmp:
        directory = os.path.join(tmp, "hf")
        src = build_gpt(args.size_gb)
        save_torch_state_dict(src.state_dict(), directory, max_shard_size=f"{args.shard_mb}MB")
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        del src
        per_rank = run_ranks(worker, args.world, args, directory)

    rows = []
    stats0 = per_rank[0]["stats"]
    base = statistics.median(stats0["load: shardgather <- HF directory"]["times"])
    for name, s in stats0.items():
        t = statistics.median(s["times"])
        rows.append(
            {
                "method": name,
                "time_s": t,
                "times_s": s["times"],
                "time_ratio_vs_shardgather": t / base,
                "peak_rss_rise_per_rank": [max(pr["stats"][name]["rss"]) for pr in per_rank],
                "page_cache_dropped": all(s["cold"]),
                "verified": s["verified"],
            }
        )
    print(
        f"\n{args.size_gb} GiB tied GPT, FSDP2, gloo, world {args.world}, {len(files)} shard files, "
        f"median of {args.repeats}, methods alternated"
    )
    print(f"{'method':72} {'time s':>7} {'x sg':>6} {'RSS rise MiB/rank':>18} cold ok")
    for r in rows:
        rss = " / ".join(f"{x / MiB:.0f}" for x in r["peak_rss_rise_per_rank"])
        print(
            f"{r['method']:72} {r['time_s']:7.3f} {r['time_ratio_vs_shardgather']:6.2f} "
            f"{rss:>18} {r['page_cache_dropped']!s:5} {r['verified']}"
        )
    import shardgather

    report = {
        "config": vars(args),
        "files": len(files),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "shardgather": shardgather.build_info(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "python " + " ".join(sys.argv),
        "results": rows,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    if any(r["verified"] is False for r in rows):
        sys.exit("a method produced wrong values")


if __name__ == "__main__":
    main()
