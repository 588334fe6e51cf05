"""Saving an FSDP model as a sharded Hugging Face directory: shardgather vs torch's own
two ways, in the same run.

    python bench/bench_hf_save.py --size-gb 1 --world 2 --fsdp 2 [--repeats 3] [--shard-mb 256] [--json out.json]

Methods (each writes a fresh directory of the same split: torch's writer is given
shardgather's file assignment through ``fqn_to_index_mapping``):

- ``save_full_state_dict(model, dir, max_shard_size=...)``: every rank pwrites its own
  pieces into the shard files, fsync'ed, published atomically;
- ``dcp.save`` with ``HuggingFaceStorageWriter(save_distributed=True,
  enable_consolidation=True)``: each rank writes its shards to ``dir/sharded``, then rank 0
  consolidates them into the HF files (torch's own fsync of each file);
- ``get_model_state_dict(full_state_dict, cpu_offload)`` + ``huggingface_hub.
  save_torch_state_dict`` on rank 0 (``safetensors.save_file`` per shard; no fsync).

Methods alternate (A B C, C B A, ...), the first round is a warm-up; medians and the peak
RSS rise of every rank (kernel high-water mark). Every method's files are checked
bit-exactly on rank 0 once, against the model's full state dict.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _ranks import run_ranks

from shardgather._memory import peak_rss_rise, trim
from shardgather.testing import Block, build_gpt

MiB = 2**20


def _sharded(model: torch.nn.Module, fsdp: int, world: int) -> torch.nn.Module:
    if fsdp == 2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"))


def _check(directory: str, want: dict[str, torch.Tensor]) -> bool:
    """Every tensor of every *.safetensors file in ``directory`` equals the model's."""
    from safetensors import safe_open

    seen = set()
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(directory, name), "pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if not torch.equal(f.get_tensor(k), want[k]):
                    return False
                seen.add(k)
    return seen >= set(want) - {"lm_head.weight"}  # tied: stored once by two writers


def worker(rank: int, world: int, args: argparse.Namespace, root: str) -> dict:
    import faulthandler

    import torch.distributed.checkpoint as dcp
    from huggingface_hub import save_torch_state_dict
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import shardgather as sg
    from shardgather._engine.sinks import file_set
    from shardgather._plan import build_plan

    faulthandler.dump_traceback_later(1200, exit=True)  # a hang ends the bench
    torch.manual_seed(0)
    model = _sharded(build_gpt(args.size_gb), args.fsdp, world)
    want = sg.full_state_dict(model)  # on every rank; {} except on rank 0
    shard = args.shard_mb * 10**6  # "256MB", as transformers reads it
    # torch's writer gets the same split: key -> file index (1-based).
    fs = file_set(build_plan(model), os.path.join(root, "x"), max_shard_size=shard)
    mapping = {k: fs.where[k][0] + 1 for k in fs.where}
    tied = set(build_plan(model).aliases)  # stored once, as transformers stores them

    def ours(d: str) -> None:
        sg.save_full_state_dict(model, d, max_shard_size=shard)

    def torch_hf_writer(d: str) -> None:
        # Tied aliases left out: safetensors refuses tensors that share memory.
        sd = {k: v for k, v in get_model_state_dict(model).items() if k not in tied}
        writer = HuggingFaceStorageWriter(
            d, fqn_to_index_mapping=mapping, save_distributed=True, enable_consolidation=True
        )
        dcp.save(sd, storage_writer=writer)

    def torch_full_rank0(d: str) -> None:
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        sd = get_model_state_dict(model, options=opts)
        if rank == 0:
            os.makedirs(d)
            save_torch_state_dict(sd, d, max_shard_size=shard)
        del sd

    methods = {
        f"FSDP{args.fsdp} save: shardgather -> HF directory (fsync'ed)": ours,
        f"FSDP{args.fsdp} save: torch dcp.save(HuggingFaceStorageWriter, distributed, "
        "consolidated)": torch_hf_writer,
        f"FSDP{args.fsdp} save: torch get_model_state_dict(full, cpu_offload) + "
        "save_torch_state_dict on rank 0": torch_full_rank0,
    }
    stats = {n: {"times": [], "rss": [], "verified": None} for n in methods}
    order = list(methods)
    run = 0
    for rep in range(args.repeats + 1):
        for name in order if rep % 2 == 0 else order[::-1]:
            run += 1
            d = os.path.join(root, f"out{run}")
            trim()
            dist.barrier()
            with peak_rss_rise() as mem:
                t0 = time.perf_counter()
                methods[name](d)
                dist.barrier()
                dt = time.perf_counter() - t0
            if rank == 0:
                if stats[name]["verified"] is None:
                    stats[name]["verified"] = _check(d, want)
                shutil.rmtree(d)
            dist.barrier()
            if rep:  # the first round is the warm-up
                stats[name]["times"].append(dt)
                stats[name]["rss"].append(mem["peak_rise"])
    return {"stats": stats, "files": len(fs.names)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--fsdp", type=int, choices=(1, 2), default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shard-mb", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sg-bench-hfsave-", dir=".") as root:
        per_rank = run_ranks(worker, args.world, args, os.path.abspath(root))
    stats0 = per_rank[0]["stats"]
    names = list(stats0)
    base = statistics.median(stats0[names[0]]["times"])
    rows = []
    for name in names:
        t = statistics.median(stats0[name]["times"])
        rows.append(
            {
                "method": name,
                "time_s": t,
                "times_s": stats0[name]["times"],
                "time_ratio_vs_shardgather": t / base,
                "peak_rss_rise_per_rank": [max(pr["stats"][name]["rss"]) for pr in per_rank],
                "verified": stats0[name]["verified"],
            }
        )
    print(
        f"\n{args.size_gb} GiB tied GPT, FSDP{args.fsdp}, gloo, world {args.world}, "
        f"{per_rank[0]['files']} files of <= {args.shard_mb} MB, median of {args.repeats}, "
        "methods alternated"
    )
    print(f"{'method':96} {'time s':>7} {'x sg':>6} {'RSS rise MiB/rank':>18} ok")
    for r in rows:
        rss = " / ".join(f"{x / MiB:.0f}" for x in r["peak_rss_rise_per_rank"])
        print(
            f"{r['method']:96} {r['time_s']:7.3f} {r['time_ratio_vs_shardgather']:6.2f} "
            f"{rss:>18} {r['verified']}"
        )
    import shardgather

    report = {
        "config": vars(args),
        "files": per_rank[0]["files"],
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
