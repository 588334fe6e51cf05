"""save_full_state_dict vs the disk's floor, alone (no other writer in the run).

    python bench/bench_save_floor.py [--size-gb 1] [--world 2] [--repeats 3]

bench_gather.py interleaves torch's saves (whose dirty pages are not fsync'ed and are
written back while later methods run), which makes its save timings noisy; this script
times only shardgather's save and one sequential write + fsync of the same bytes.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, world: int, args: argparse.Namespace, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/rdzv",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(minutes=10),
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    import shardgather as sg
    from shardgather.testing import Block, build_gpt

    model = FSDP(
        build_gpt(args.size_gb),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        device_id=torch.device("cpu"),
    )
    path = os.path.join(args.dir, "bench_save.safetensors")
    for i in range(args.repeats + 1):
        dist.barrier()
        t = time.perf_counter()
        sg.save_full_state_dict(model, path)
        dist.barrier()
        if rank == 0:
            print(
                f"save_full_state_dict run {i}: {time.perf_counter() - t:.3f} s"
                + (" (warm-up)" if i == 0 else ""),
                flush=True,
            )
    if rank == 0:
        nbytes = os.path.getsize(path)
        os.unlink(path)
        buf = torch.ones(nbytes, dtype=torch.uint8)
        for i in range(args.repeats):
            t = time.perf_counter()
            with open(path, "wb") as f:
                f.write(memoryview(buf.numpy()))
                f.flush()
                os.fsync(f.fileno())
            print(
                f"floor (one write of {nbytes / 2**30:.2f} GiB + fsync) run {i}: "
                f"{time.perf_counter() - t:.3f} s",
                flush=True,
            )
        os.unlink(path)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sg-save-") as tmp:
        mp.spawn(worker, args=(args.world, args, tmp), nprocs=args.world)


if __name__ == "__main__":
    main()
