"""The process scaffolding the bench scripts share: spawn W gloo ranks, let each write
its result before the process group goes, collect them (a rank that died or raised
ends the bench with its traceback)."""

from __future__ import annotations

import datetime
import faulthandler
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardgather._memory import peak_rss_rise, trim


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


def evict(paths: list[str]) -> bool:
    """Make reading these files (or every file under these directories) cold: the whole
    page cache where allowed, else their own pages (written back, then
    POSIX_FADV_DONTNEED — what a container that may not write drop_caches can do)."""
    if drop_caches():
        return True
    os.sync()
    files = []
    for p in paths:
        if os.path.isdir(p):
            files += [os.path.join(d, n) for d, _, names in os.walk(p) for n in names]
        elif os.path.exists(p):
            files.append(p)
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def timed(
    stats: dict, methods: dict[str, Callable[[int], None]], repeats: int, before=None, after=None
) -> None:  # type: ignore[no-untyped-def, type-arg]
    """Run each method ``repeats + 1`` times, alternating their order (A B, B A, ...); the
    first round is a warm-up. Each rank records its times, peak RSS rise and whether
    ``before`` made the cache cold, under ``stats[name]``."""
    order = list(methods)
    run = 0
    for rep in range(repeats + 1):
        for name in order if rep % 2 == 0 else order[::-1]:
            run += 1
            cold = before() if before else False
            trim()
            dist.barrier()
            with peak_rss_rise() as mem:
                t0 = time.perf_counter()
                methods[name](run)
                dist.barrier()
                dt = time.perf_counter() - t0
            if after:
                after(name, run)
            dist.barrier()
            if rep:  # the first round is the warm-up
                stats[name]["times"].append(dt)
                stats[name]["rss"].append(mem["peak_rise"])
                stats[name]["cold"].append(cold)


def method_rows(per_rank: list[dict]) -> list[dict]:  # type: ignore[type-arg]
    """One row per method of :func:`timed`'s stats: rank 0's median time, its ratio to
    the first method of its section ("section: method" names; shardgather's comes
    first), every rank's worst peak RSS rise and whether rank 0 verified its output."""
    r0 = per_rank[0]
    rows = []
    base: dict[str, float] = {}
    for name in r0["stats"]:
        t = statistics.median(r0["stats"][name]["times"])
        base.setdefault(name.split(":")[0], t)
        rows.append(
            {
                "method": name,
                "time_s": t,
                "times_s": r0["stats"][name]["times"],
                "time_ratio_vs_shardgather": t / base[name.split(":")[0]],
                "peak_rss_rise_per_rank": [max(pr["stats"][name]["rss"]) for pr in per_rank],
                "verified": r0["verified"].get(name),
            }
        )
    return rows


def run_child(code: str, *argv: str, timeout: float = 1200) -> dict:
    """``code`` in a fresh interpreter (its own peak RSS, no warm caches of another
    method's), with this repository and bench/ importable; its last stdout line, as JSON.
    A failure ends the bench with the child's stderr."""
    import json
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), here]))
    res = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    if res.returncode:
        sys.exit(f"{' '.join(argv[:1])} failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def write_json(path: str | None, script: str, args: Any, **doc: Any) -> None:
    """The result document every bench writes: its configuration, the machine, the date,
    the command that reproduces it, then ``doc``."""
    if not path:
        return
    import datetime as _dt
    import json
    import platform

    out = {
        "config": vars(args),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": f"python bench/{script} " + " ".join(sys.argv[1:]),
        **doc,
    }
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")
