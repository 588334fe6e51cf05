"""Saving while training runs: how long training stands still per save, and how fast it
trains while the save is written — shardgather and torch's DCP async_save, same model,
same run.

    python bench/bench_async.py --size-gb 1 --world 2 [--repeats 4] [--json out.json]

FSDP2 on the CPU (gloo), a tied GPT of S GiB; methods alternate (rotated order every
repeat, the first repeat a warm-up), medians; per rank, then the slower rank:

- ``memcpy``: one copy of the rank's own shard into a buffer already faulted in — the
  unit of the target ("blocked <= 1.5x one memcpy of the rank's shard");
- ``sync``: ``save_full_state_dict`` — training stands still for all of it;
- ``async``: ``save_full_state_dict(blocking=False)`` (snapshot into the buffer kept from
  the previous save): blocked = the call; durable = until ``wait()`` returns, called at
  once (the end-to-end time to an fsync'ed, published file); ``async first``: the very
  first such save (a fresh buffer, first touched);
- ``dcp``: ``dcp.async_save(get_model_state_dict(model))`` with its default stager (a
  fresh CPU copy each time): blocked = the call; durable = ``future.result()``. Its
  output is a sharded DCP directory, not one file.

Training throughput: a small training loop (an MLP with AdamW, local to each rank) runs
alone (``--train-s``), and right after an async save's call until that rank's background
writes end (at the disk's pace, and at each ``--write-mb-per-s``) — alternated, rotated
every repeat, because this VM's speed drifts between minutes.

Every shardgather file is checked bit-exactly once: parameters perturbed in place right
after the call, the file must hold the values at call time.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _ranks import run_ranks
from bench_hf_save import _sharded

from shardgather.testing import build_gpt


def _own_shard(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]


def _trainer() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(1)
    net = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512)
    )
    return net, torch.optim.AdamW(net.parameters(), lr=1e-4), torch.randn(64, 512)


def _step(net: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    net(x).pow(2).mean().backward()
    opt.step()


def worker(rank: int, world: int, args: argparse.Namespace, root: str) -> dict:
    import faulthandler

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    import shardgather as sg

    faulthandler.dump_traceback_later(1800, exit=True)  # a hang ends the bench
    torch.manual_seed(0)
    model = _sharded(build_gpt(args.size_gb), 2, world)
    shard = _own_shard(model)
    own_bytes = sum(t.numel() * t.element_size() for t in shard)
    target = torch.empty(own_bytes, dtype=torch.uint8)
    target.zero_()  # faulted in

    def memcpy() -> dict:
        t = time.perf_counter()
        off = 0
        for s in shard:
            n = s.numel() * s.element_size()
            target[off : off + n].copy_(s.reshape(-1).view(torch.uint8))
            off += n
        return {"blocked": time.perf_counter() - t}

    def sync() -> dict:
        dist.barrier()
        t = time.perf_counter()
        sg.save_full_state_dict(model, f"{root}/sync.safetensors")
        return {"blocked": time.perf_counter() - t, "durable": time.perf_counter() - t}

    def async_() -> dict:
        dist.barrier()
        t = time.perf_counter()
        h = sg.save_full_state_dict(model, f"{root}/async.safetensors", blocking=False)
        blocked = time.perf_counter() - t
        h.wait()
        return {"blocked": blocked, "durable": time.perf_counter() - t}

    def dcp_async() -> dict:
        out = f"{root}/dcp"
        shutil.rmtree(out, ignore_errors=True)
        dist.barrier()
        t = time.perf_counter()
        fut = dcp.async_save(get_model_state_dict(model), checkpoint_id=out)
        blocked = time.perf_counter() - t
        fut.result()
        return {"blocked": blocked, "durable": time.perf_counter() - t}

    first = async_()  # the first async save of the job: a fresh snapshot buffer
    methods = {"memcpy": memcpy, "sync": sync, "async": async_, "dcp": dcp_async}
    names = list(methods)
    got: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.repeats + 1):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            res = methods[n]()
            if r > 0:
                got[n].append(res)

    # Training throughput alone and while an async save is written in the background,
    # alternated (rotated order every repeat): this VM drifts between minutes.
    net, opt, x = _trainer()
    for _ in range(3):
        _step(net, opt, x)

    def train_alone() -> dict:
        dist.barrier()
        t = time.perf_counter()
        steps = 0
        while time.perf_counter() - t < args.train_s:
            _step(net, opt, x)
            steps += 1
        return {"steps_per_s": steps / (time.perf_counter() - t)}

    def train_during(pace: float | None) -> dict:
        dist.barrier()
        h = sg.save_full_state_dict(
            model, f"{root}/async.safetensors", blocking=False, write_mb_per_s=pace
        )
        t = time.perf_counter()
        steps = 0
        while not h.done():
            _step(net, opt, x)
            steps += 1
        spent = time.perf_counter() - t
        h.wait()
        durable = time.perf_counter() - t
        return {
            "steps": steps,
            "window_s": spent,
            "steps_per_s": steps / spent,
            "durable_s": durable,
        }

    cases: list[tuple[str, Any]] = [("alone", train_alone)]
    for pace in [None, *args.write_mb_per_s]:
        name = "disk's pace" if pace is None else f"{pace:g} MB/s"
        cases.append((name, functools.partial(train_during, pace)))
    during: dict[str, list[dict]] = {name: [] for name, _ in cases}
    for r in range(args.repeats):
        for name, fn in cases[r % len(cases) :] + cases[: r % len(cases)]:
            during[name].append(fn())

    # Verification: the file holds the values at call time, whatever happens after.
    want = sg.full_state_dict(model)
    h = sg.save_full_state_dict(model, f"{root}/check.safetensors", blocking=False)
    with torch.no_grad():
        for p in shard:
            p.add_(1.0)  # what an optimizer step does: in place, right after the call
    h.wait()
    verified = None
    if rank == 0:
        back = sg.load_file(f"{root}/check.safetensors")
        verified = set(back) == set(want) and all(torch.equal(back[k], want[k]) for k in want)
    return {
        "own_bytes": own_bytes,
        "first_async": first,
        "results": got,
        "train": during,
        "verified": verified,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument(
        "--train-s", type=float, default=1.0, help="seconds of training alone, per repeat"
    )
    ap.add_argument(
        "--write-mb-per-s",
        type=float,
        nargs="*",
        default=[],
        help="also train during saves written at these paces (MB/s per rank)",
    )
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="sg-async-", dir=args.dir)
    try:
        per_rank = run_ranks(worker, args.world, args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def med(name: str, key: str) -> float:
        """The slower rank's median (training waits for the slowest)."""
        return max(statistics.median(x[key] for x in r["results"][name]) for r in per_rank)

    rows = {
        "memcpy of own shard": (med("memcpy", "blocked"), None),
        "sync save_full_state_dict": (med("sync", "blocked"), med("sync", "durable")),
        "async (first save)": (
            max(r["first_async"]["blocked"] for r in per_rank),
            max(r["first_async"]["durable"] for r in per_rank),
        ),
        "async (steady)": (med("async", "blocked"), med("async", "durable")),
        "dcp.async_save (default stager)": (med("dcp", "blocked"), med("dcp", "durable")),
    }
    own = max(r["own_bytes"] for r in per_rank)
    print(
        f"\nFSDP2, {args.size_gb} GiB, world {args.world}, own shard {own / 2**20:.0f} MiB/rank; "
        f"medians of {args.repeats} (slower rank)"
    )
    print(f"{'method':36s} {'blocked s':>10s} {'durable s':>10s}")
    for name, (b, d) in rows.items():
        print(f"{name:36s} {b:10.3f} {('' if d is None else f'{d:10.3f}'):>10s}")
    memcpy, sync_t = rows["memcpy of own shard"][0], rows["sync save_full_state_dict"][0]
    blocked, durable = rows["async (steady)"]
    ratios = {
        "blocked / memcpy": blocked / memcpy,
        "blocked / sync": blocked / sync_t,
        "blocked / dcp blocked": blocked / rows["dcp.async_save (default stager)"][0],
        "durable / sync": durable / sync_t,
    }
    alone = min(statistics.median(d["steps_per_s"] for d in r["train"]["alone"]) for r in per_rank)
    training = {}
    for pace in per_rank[0]["train"]:
        if pace == "alone":
            continue
        runs = [r["train"][pace] for r in per_rank]
        during = min(statistics.median(d["steps_per_s"] for d in rs) for rs in runs)
        window = max(statistics.median(d["window_s"] for d in rs) for rs in runs)
        durable = max(statistics.median(d["durable_s"] for d in rs) for rs in runs)
        training[pace] = {
            "steps_per_s": during,
            "ratio": during / alone,
            "window_s": window,
            "durable_s": durable,
        }
    ratios["train steps/s during / alone"] = training["disk's pace"]["ratio"]
    for k, v in ratios.items():
        print(f"{k:36s} {v:10.3f}")
    print(f"training alone: {alone:.1f} steps/s; while a save is written in the background:")
    for pace, t in training.items():
        print(
            f"  {pace:14s} {t['steps_per_s']:7.1f} steps/s ({t['ratio']:.2f}), window "
            f"{t['window_s']:.2f} s, durable after {t['durable_s']:.2f} s (training all along)"
        )
    print(f"verified: {per_rank[0]['verified']}")
    if args.json:
        out = {
            "command": "python " + " ".join(sys.argv),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "torch": torch.__version__,
            },
            "rows_s": {k: {"blocked": b, "durable": d} for k, (b, d) in rows.items()},
            "ratios": ratios,
            "train_steps_per_s": {"alone": alone, "during": training},
            "per_rank": per_rank,
            "verified": per_rank[0]["verified"],
        }
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")
    if not per_rank[0]["verified"]:
        sys.exit("the async file does not hold the values at call time")


if __name__ == "__main__":
    main()
