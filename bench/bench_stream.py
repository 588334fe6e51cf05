"""Weight sync every step: shardgather's stream vs the loops RL stacks run today.

    python bench/bench_stream.py --sizes 0.25 1 2 --world 2 [--repeats 3] [--json out.json]

Spawns W processes per size, builds a tied GPT of S GiB fp32, shards it with FSDP2 and
hands every full tensor to a consumer that stands in for an inference engine: it copies
each tensor into weights of its own, allocated (and touched) before anything is timed,
on every rank (engines often sit on every rank's GPU). Methods, alternated within one
run (median of --repeats after a warm-up):

- stream: ``Gatherer.iter_full_tensors(rank0_only=False)``, steady state (one gatherer
  kept across calls), and its first call (a fresh ``shardgather.iter_full_tensors``);
- per-parameter ``DTensor.full_tensor()`` over ``named_parameters()`` + buffers (TRL,
  open-instruct, verl's simple path);
- ``get_model_state_dict(full_state_dict=True)``, then the loop over its dict.

After each method's warm-up the engine's weights are compared bit-exactly with torch's
full state dict. Reported per method: time, the peak RSS rise of every rank (kernel
high-water mark) and, for the stream, the bound it promises (2 buckets + the largest
parameter spread over buckets + 64 MiB).

Then the dict verb repeated: ``Gatherer.full_state_dict()`` (same output every call) vs
``shardgather.full_state_dict()`` (fresh output every call), alternated, --calls calls
each, time and RSS + shared-memory rise per call, and bit-exactness after every step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _ranks import run_ranks

from shardgather._memory import peak_rss_rise, trim
from shardgather.testing import build_gpt

MiB = 2**20


def _shard(model: torch.nn.Module, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _torch_full(model: torch.nn.Module, everyone: bool) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=not everyone)
    return get_model_state_dict(model, options=opts)


def _stream_methods(model: torch.nn.Module, args: argparse.Namespace, engine: dict) -> dict:
    from torch.distributed.tensor import DTensor

    import shardgather as sg

    def consume(key: str, t: torch.Tensor) -> None:
        engine[key].copy_(t)

    gatherer = sg.Gatherer(model, bucket_mb=args.bucket_mb, rank0_only=False)

    def stream_steady() -> None:
        for k, t in gatherer.iter_full_tensors():
            consume(k, t)

    def stream_first() -> None:
        for k, t in sg.iter_full_tensors(model, bucket_mb=args.bucket_mb, rank0_only=False):
            consume(k, t)

    def per_parameter() -> None:
        for k, p in [*model.named_parameters(), *model.named_buffers()]:
            consume(k, p.full_tensor() if isinstance(p, DTensor) else p)

    def whole_dict() -> None:
        sd = _torch_full(model, everyone=True)
        for k, v in sd.items():
            if k in engine:  # a tied alias is not an engine weight of its own
                consume(k, v)

    def transport_floor() -> None:
        # What no stream over gloo can beat: the same bucket gathers, nothing copied out
        # and nothing consumed (engine left as is; not verified).
        import datetime as dt

        from shardgather._dist import Call, data_group
        from shardgather._engine.buckets import my_buckets
        from shardgather._engine.collective import BucketGathers
        from shardgather._plan import build_plan

        with Call("floor", dt.timedelta(minutes=5)) as call:
            plan = build_plan(model)
            call.round("plan", same=plan.fingerprint)
            buckets = my_buckets(plan, args.bucket_mb, False)
            gathers = BucketGathers(
                call, buckets, lambda b: True, to_one=False, group=data_group(call), slots=1
            )
            gathers.launch(0)
            for i in range(len(buckets)):
                gathers.wait(i)
                if i + 1 < len(buckets):
                    gathers.launch(i + 1)

    return {
        "stream: floor: the same bucket gathers alone (no copy-out, no consumer)": transport_floor,
        "stream: shardgather Gatherer.iter_full_tensors (steady)": stream_steady,
        "stream: shardgather iter_full_tensors (first call, fresh buffers)": stream_first,
        "stream: per-parameter DTensor.full_tensor()": per_parameter,
        "stream: torch get_model_state_dict(full_state_dict) + loop": whole_dict,
    }


def _engine_equal(engine: dict, model: torch.nn.Module) -> bool:
    ref = _torch_full(model, everyone=True)
    return all(torch.equal(engine[k], ref[k]) for k in engine)


def _run_once(fn) -> tuple[float, int, int]:  # type: ignore[no-untyped-def]
    dist.barrier()
    with peak_rss_rise() as mem:
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        dt = time.perf_counter() - t0
    return dt, mem["peak_rise"], mem["shm_rise"]


def worker(rank: int, world: int, args: argparse.Namespace, size_gb: float) -> dict:
    """One rank of one size: the stream methods, then the dict verb repeated."""
    import shardgather as sg

    out: dict = {}
    model = _shard(build_gpt(size_gb, width=args.width), world)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    out["params"] = sum(1 for _ in model.parameters())
    # The engine's own weights: allocated and touched before anything is timed.
    engine = {
        k: torch.zeros(p.shape, dtype=p.dtype)
        for k, p in [*model.named_parameters(), *model.named_buffers()]
    }
    trim()
    methods = _stream_methods(model, args, engine)
    stats: dict = {name: {"times": [], "rss": [], "verified": None} for name in methods}
    for name, fn in methods.items():  # warm-up, verified
        for t in engine.values():
            t.zero_()
        _run_once(fn)
        if "floor" not in name:
            stats[name]["verified"] = _engine_equal(engine, model)
    order = list(methods)
    for rep in range(args.repeats):
        for name in order if rep % 2 == 0 else order[::-1]:
            dt, rss, _ = _run_once(methods[name])
            stats[name]["times"].append(dt)
            stats[name]["rss"].append(rss)
            trim()
    out["stream"] = stats
    out["largest"] = largest
    del engine, methods
    trim()

    # The dict verb, repeated.
    if size_gb == args.dict_size_gb:
        g = sg.Gatherer(model, bucket_mb=args.bucket_mb)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        calls: dict = {"reused": [], "fresh": []}
        ok = True
        for i in range(args.calls):
            for p in model.parameters():  # a "training step": every call sees new values
                p.grad = torch.full_like(p, 1e-3)
            opt.step()
            for name in ("reused", "fresh") if i % 2 == 0 else ("fresh", "reused"):
                fn = g.full_state_dict if name == "reused" else (lambda: sg.full_state_dict(model))
                box: list = []
                dt, rss, shm = _run_once(lambda fn=fn, box=box: box.append(fn()))
                calls[name].append((dt, rss, shm))
                if name == "reused":
                    ref = _torch_full(model, everyone=False)
                    if rank == 0:
                        ok &= all(torch.equal(box[0][k], ref[k]) for k in ref)
                    del ref
                del box
                trim()
        g.close()
        out["dict"] = {"calls": calls, "verified": ok}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=[1.0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--bucket-mb", type=float, default=16)
    ap.add_argument(
        "--width", type=int, default=None, help="model dimension (narrow: many small params)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calls", type=int, default=20, help="repeated dict calls per method")
    ap.add_argument("--dict-size-gb", type=float, default=1.0, help="size for the dict part")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    rows, dict_rows, params = [], [], {}
    for size in args.sizes:
        per_rank = run_ranks(worker, args.world, args, size)
        params[size] = per_rank[0]["params"]
        largest = per_rank[0]["largest"]
        bucket = int(args.bucket_mb * MiB)
        bound = 2 * bucket + (largest if largest > bucket else 0) + 64 * MiB
        base = statistics.median(
            per_rank[0]["stream"]["stream: shardgather Gatherer.iter_full_tensors (steady)"][
                "times"
            ]
        )
        for name, s in per_rank[0]["stream"].items():
            t = statistics.median(s["times"])
            rows.append(
                {
                    "size_gb": size,
                    "method": name,
                    "time_s": t,
                    "times_s": s["times"],
                    "time_ratio_vs_stream": t / base,
                    "peak_rss_rise_per_rank": [max(pr["stream"][name]["rss"]) for pr in per_rank],
                    "stream_bound": bound if "shardgather" in name else None,
                    "verified": None
                    if "floor" in name
                    else all(pr["stream"][name]["verified"] for pr in per_rank),
                }
            )
        if "dict" in per_rank[0]:
            for name in ("reused", "fresh"):
                calls = [pr["dict"]["calls"][name] for pr in per_rank]
                times = [c[0] for c in calls[0]]
                dict_rows.append(
                    {
                        "size_gb": size,
                        "method": f"full_state_dict, {name} output",
                        "first_s": times[0],
                        "steady_median_s": statistics.median(times[1:]),
                        "rss_plus_shm_rise_per_call_rank0": [c[1] + c[2] for c in calls[0]],
                        "rss_rise_per_call_rank1": [c[1] for c in calls[1]]
                        if len(calls) > 1
                        else None,
                        "verified": per_rank[0]["dict"]["verified"],
                    }
                )

    print(
        f"\nFSDP2, gloo, world {args.world}, bucket {args.bucket_mb} MiB, median of "
        f"{args.repeats}; parameters per size: {params}"
    )
    print(
        f"{'GiB':>4} {'method':72} {'time s':>7} {'x stream':>8} {'RSS rise MiB/rank':>18} {'bound':>6} ok"
    )
    for r in rows:
        rss = " / ".join(f"{x / MiB:.0f}" for x in r["peak_rss_rise_per_rank"])
        bound = f"{r['stream_bound'] / MiB:.0f}" if r["stream_bound"] else ""
        print(
            f"{r['size_gb']:4} {r['method']:72} {r['time_s']:7.3f} "
            f"{r['time_ratio_vs_stream']:8.2f} {rss:>18} {bound:>6} {r['verified']}"
        )
    for r in dict_rows:
        rises = r["rss_plus_shm_rise_per_call_rank0"]
        print(
            f"{r['size_gb']:4} {r['method']:40} first {r['first_s']:.3f} s, steady "
            f"{r['steady_median_s']:.3f} s; rank 0 RSS+shm rise per call MiB: first "
            f"{rises[0] / MiB:.0f}, then max {max(rises[1:]) / MiB:.0f}; verified {r['verified']}"
        )
    if len(dict_rows) == 2:
        ratio = dict_rows[1]["steady_median_s"] / dict_rows[0]["steady_median_s"]
        print(f"reused vs fresh output, steady state: {ratio:.2f}x faster")
    import shardgather

    report = {
        "config": vars(args),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "shardgather": shardgather.build_info(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "python " + " ".join(sys.argv),
        "params_per_size": params,
        "stream": rows,
        "dict": dict_rows,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    if any(r["verified"] is False for r in rows + dict_rows):
        sys.exit("a method produced wrong values")


if __name__ == "__main__":
    main()
