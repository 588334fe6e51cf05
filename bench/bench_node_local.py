"""Where the node-local gather's time goes, shardgather alone (no torch paths, no
memory sampler, no other output alive): per run, the wall time of full_state_dict and
each rank's time inside its own pwrites.

    python bench/bench_node_local.py --size-gb 1.5 --world 2 --fsdp fsdp1 --runs 6

bench_gather.py measures the same call next to torch's paths; on this project's
2-vCPU VM its shardgather timings swing 2-3x from run to run (fresh tmpfs pages cost
what the hypervisor makes them cost), which this script shows phase by phase.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def worker(rank: int, world: int, args: argparse.Namespace, tmp: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/rdzv",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(minutes=10),
    )
    from bench_gather import _shard

    import shardgather as sg
    from shardgather._engine import run
    from shardgather.testing import build_gpt

    model = _shard(args.fsdp, build_gpt(args.size_gb), torch.device("cpu"), world)
    real = run.write_pieces
    spent: list[float] = []

    def timed(*a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        real(*a, **k)
        spent.append(time.perf_counter() - t)

    run.write_pieces = timed
    for i in range(args.runs + 1):
        spent.clear()
        dist.barrier()
        t = time.perf_counter()
        sd = sg.full_state_dict(model)
        dist.barrier()
        total = time.perf_counter() - t
        writes: list = [None] * world
        dist.all_gather_object(writes, sum(spent))
        if rank == 0:
            nbytes = sum(v.numel() * v.element_size() for v in set(sd.values()))
            print(
                f"{args.fsdp} run {i}{' (warm-up)' if i == 0 else ''}: "
                f"{nbytes / 2**30:.2f} GiB in {total:.3f} s; pwrites per rank "
                + " / ".join(f"{w:.3f}" for w in writes)
                + " s",
                flush=True,
            )
        del sd
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.5)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--fsdp", choices=["fsdp1", "fsdp2"], default="fsdp1")
    ap.add_argument("--runs", type=int, default=6)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sg-nl-") as tmp:
        mp.spawn(worker, args=(args.world, args, tmp), nprocs=args.world)


if __name__ == "__main__":
    main()
