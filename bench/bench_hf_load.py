"""Loading a sharded Hugging Face directory into an FSDP2 (or FSDP1) model: shardgather vs torch's
own HF path (``dcp.load`` with ``HuggingFaceStorageReader`` + ``set_model_state_dict``).

    python bench/bench_hf_load.py --size-gb 1 --world 2 --fsdp 2 [--repeats 3] [--shard-mb 256] [--json out.json]

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
from _ranks import drop_caches, run_ranks

from shardgather._memory import peak_rss_rise, trim
from shardgather.testing import build_gpt

MiB = 2**20


def _io() -> dict[str, int]:
    """This process's I/O counters: rchar (bytes its read/pread calls returned),
    read_bytes (bytes fetched from storage for it, readahead included)."""
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def worker(rank: int, world: int, args: argparse.Namespace, directory: str) -> dict:
    """One rank: both methods, alternated, each verified."""
    import torch.distributed.checkpoint as dcp
    from bench_hf_save import _sharded
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    import shardgather as sg

    model = build_gpt(args.size_gb)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model = _sharded(model, args.fsdp, world)
    want = build_gpt(args.size_gb).state_dict() if rank == 0 else None

    def ours() -> None:
        sg.load_full_state_dict(model, directory)

    def torch_hf() -> None:
        # The tied lm_head is not in the files (stored once, as HF does); left in the
        # dict, its unread value would overwrite the embedding it shares (FSDP1).
        sd = {k: v for k, v in get_model_state_dict(model).items() if k != "lm_head.weight"}
        dcp.load(sd, storage_reader=HuggingFaceStorageReader(directory))
        set_model_state_dict(model, sd, options=StateDictOptions(strict=False))

    methods = {
        f"FSDP{args.fsdp} load: shardgather <- HF directory": ours,
        f"FSDP{args.fsdp} load: torch dcp.load(HuggingFaceStorageReader) + "
        "set_model_state_dict": torch_hf,
    }
    stats = {
        n: {"times": [], "rss": [], "verified": None, "cold": [], "rchar": [], "read_bytes": []}
        for n in methods
    }
    order = list(methods)
    for rep in range(args.repeats + 1):
        for name in order if rep % 2 == 0 else order[::-1]:
            with torch.no_grad():
                for p in model.parameters():
                    (p.to_local() if hasattr(p, "to_local") else p).zero_()
            cold = [False]
            if rank == 0:
                cold[0] = drop_caches()
            dist.broadcast_object_list(cold, src=0)
            trim()
            dist.barrier()
            io0 = _io()
            with peak_rss_rise() as mem:
                t0 = time.perf_counter()
                methods[name]()
                dist.barrier()
                dt = time.perf_counter() - t0
            io1 = _io()
            got = sg.full_state_dict(model)
            if rank == 0:
                ok = all(torch.equal(got[k], want[k]) for k in want)
                stats[name]["verified"] = ok and stats[name]["verified"] is not False
            del got
            if rep:  # the first round is the warm-up
                stats[name]["times"].append(dt)
                stats[name]["rss"].append(mem["peak_rise"])
                stats[name]["cold"].append(cold[0])
                stats[name]["rchar"].append(io1["rchar"] - io0["rchar"])
                stats[name]["read_bytes"].append(io1["read_bytes"] - io0["read_bytes"])
    return {"stats": stats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--fsdp", type=int, choices=(1, 2), default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shard-mb", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from huggingface_hub import save_torch_state_dict

    with tempfile.TemporaryDirectory(prefix="sg-bench-hf-") as tmp:
        directory = os.path.join(tmp, "hf")
        src = build_gpt(args.size_gb)
        os.makedirs(directory)
        save_torch_state_dict(src.state_dict(), directory, max_shard_size=f"{args.shard_mb}MB")
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        del src
        per_rank = run_ranks(worker, args.world, args, directory)

    rows = []
    stats0 = per_rank[0]["stats"]
    base = statistics.median(stats0[next(iter(stats0))]["times"])
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
                # Bytes each rank read (syscalls; mmap'ed reads show in read_bytes only).
                "rchar_per_rank": [max(pr["stats"][name]["rchar"]) for pr in per_rank],
                "read_bytes_per_rank": [max(pr["stats"][name]["read_bytes"]) for pr in per_rank],
                "verified": s["verified"],
            }
        )
    print(
        f"\n{args.size_gb} GiB tied GPT, FSDP{args.fsdp}, gloo, world {args.world}, {len(files)} shard files, "
        f"median of {args.repeats}, methods alternated"
    )
    print(
        f"{'method':80} {'time s':>7} {'x sg':>6} {'RSS rise MiB/rank':>18} "
        f"{'read MiB/rank (storage)':>26} cold ok"
    )
    for r in rows:
        rss = " / ".join(f"{x / MiB:.0f}" for x in r["peak_rss_rise_per_rank"])
        rd = " / ".join(
            f"{a / MiB:.0f} ({b / MiB:.0f})"
            for a, b in zip(r["rchar_per_rank"], r["read_bytes_per_rank"])
        )
        print(
            f"{r['method']:80} {r['time_s']:7.3f} {r['time_ratio_vs_shardgather']:6.2f} "
            f"{rss:>18} {rd:>26} {r['page_cache_dropped']!s:5} {r['verified']}"
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
