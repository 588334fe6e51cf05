"""The process scaffolding the bench scripts share: spawn W gloo ranks, let each write
its result before the process group goes, collect them (a rank that died or raised
ends the bench with its traceback)."""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(target: Callable[..., dict], rank: int, world: int, tmp: str, args: tuple) -> None:
    faulthandler.enable()  # a crash in a rank shows where
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/rdzv",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(minutes=20),
    )
    try:
        out = target(rank, world, *args)
    except BaseException:
        out = {"__error__": traceback.format_exc()}
    torch.save(out, f"{tmp}/rank{rank}.pt")  # before tearing the group down
    try:
        dist.destroy_process_group()
    finally:
        os._exit(0)


def run_ranks(target: Callable[..., dict], world: int, *args: Any) -> list[dict]:
    """``target(rank, world, *args)`` on ``world`` spawned gloo ranks; their results."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="sg-bench-") as tmp:
        procs = [
            ctx.Process(target=_entry, args=(target, r, world, tmp, args)) for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        per_rank, errors = [], []
        for r in range(world):
            path = Path(tmp) / f"rank{r}.pt"
            if not path.exists():
                errors.append(f"rank {r} died (exit code {procs[r].exitcode})")
                continue
            res = torch.load(path, weights_only=False)
            if "__error__" in res:
                errors.append(f"rank {r} failed:\n{res['__error__']}")
            per_rank.append(res)
    if errors:
        sys.exit("\n".join(errors))
    return per_rank


def drop_caches() -> bool:
    """Drop the page cache (root only); False when it could not be dropped."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False
