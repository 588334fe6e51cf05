"""Run a function in N real processes (gloo, CPU) and collect what each returns.

Workers write their result to a file *before* tearing the process group down and
then leave with os._exit: gloo can abort while the interpreter shuts down after a
successful run, and that must not turn a pass into a failure. The parent kills
every worker on timeout, so a hung collective fails the test instead of hanging it.
"""

from __future__ import annotations

import datetime
import importlib
import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def _worker(rank: int, world: int, target: str, kwargs: dict, tmp: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    result: Any
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/rendezvous",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
        module_name, fn_name = target.rsplit(":", 1)
        fn = getattr(importlib.import_module(module_name), fn_name)
        result = fn(rank, world, **kwargs)
    except BaseException:
        result = {"__error__": traceback.format_exc()}
    torch.save(result, f"{tmp}/result_{rank}.pt")
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        os._exit(0)


def _alone(target: str, kwargs: dict, tmp: str, rank: int) -> None:
    """A process outside the ranks' group (an inference worker beside a trainer)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    result: Any
    try:
        module_name, fn_name = target.rsplit(":", 1)
        result = getattr(importlib.import_module(module_name), fn_name)(**kwargs)
    except BaseException:
        result = {"__error__": traceback.format_exc()}
    torch.save(result, f"{tmp}/result_{rank}.pt")
    os._exit(0)


def run(
    target: str,
    world: int,
    timeout: float = 300,
    _allow_missing: tuple[int, ...] = (),
    alongside: str | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``module:function(rank, world, **kwargs)`` on ``world`` gloo ranks.

    ``alongside``: also ``module:function(**kwargs)`` in one more process that is not in
    the ranks' group; its result comes last (index ``world``).

    Returns:
        Each rank's return value (None for a rank in ``_allow_missing`` that left no
        result). Raises AssertionError naming the rank on an exception in a worker, a
        missing result or a timeout.
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="sg-dist-") as tmp:
        procs = [
            ctx.Process(target=_worker, args=(r, world, target, kwargs, tmp), daemon=True)
            for r in range(world)
        ]
        if alongside is not None:
            procs.append(
                ctx.Process(target=_alone, args=(alongside, kwargs, tmp, world), daemon=True)
            )
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results = []
        for r in range(len(procs)):
            path = Path(tmp) / f"result_{r}.pt"
            if not path.exists() and r in _allow_missing:
                results.append(None)
                continue
            if not path.exists():
                raise AssertionError(
                    f"rank {r} produced no result (hung: {hung}, exit code {procs[r].exitcode})"
                )
            res = torch.load(path, weights_only=False)
            if isinstance(res, dict) and "__error__" in res:
                raise AssertionError(f"rank {r} raised:\n{res['__error__']}")
            results.append(res)
        return results
