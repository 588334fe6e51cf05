"""Consolidating a DeepSpeed ZeRO-3 checkpoint: ``shardgather consolidate`` vs
DeepSpeed's own ``zero_to_fp32`` writing safetensors, in the same run.

    python bench/bench_deepspeed.py --size-gb 1.5 [--repeats 3] [--json out.json]

The checkpoint is written once by the real DeepSpeed (0.19.8, CPU accelerator, 2 gloo
ranks, ZeRO-3, torch AdamW, one training step: fp32 partitions and both Adam moments in
each rank's optimizer file). Then, alternated (A B C, C B A, ...), each method runs in
a fresh process with the checkpoint's pages evicted from the page cache first
(drop_caches where allowed, else POSIX_FADV_DONTNEED on its files):

- ``python -m shardgather consolidate DIR out.safetensors`` (default: two reader threads
  beside the O_DIRECT writer; fsync'ed);
- the same with ``--workers 1`` (one reader);
- ``deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(DIR, OUT,
  safe_serialization=True)``, then an fsync of what it wrote (it does not fsync).

The model is the tied GPT of ``shardgather.testing`` with its head untied: with the
tie, ``zero_to_fp32``'s safetensors output fails ("Some tensors share memory"), while
shardgather stores a tied tensor once. Reported: median time, the process's peak RSS
rise (kernel high-water mark; file pages mapped by a reader count), bit-exactness of
both outputs against each other (and DeepSpeed's own tensors: see
tests/test_deepspeed.py for the engine oracle).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
from _ranks import evict, run_child, run_ranks, write_json

MiB = 2**20
HERE = os.path.dirname(os.path.abspath(__file__))


def save_worker(rank: int, world: int, size_gb: float, directory: str) -> dict:
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import deepspeed

    from shardgather.testing import build_gpt

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    model = build_gpt(size_gb)
    model.lm_head.weight = torch.nn.Parameter(model.embed.weight.detach().clone())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    x = torch.randint(0, 32000, (1, 8), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    engine.save_checkpoint(directory)
    return {}


_CHILD = r"""
import json, os, sys, time
from shardgather._memory import peak_rss_rise
method, src, out = sys.argv[1:4]
import torch
with peak_rss_rise() as m:
    t = time.perf_counter()
    if method == "zero_to_fp32":
        os.environ["DS_ACCELERATOR"] = "cpu"
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
        convert_zero_checkpoint_to_fp32_state_dict(src, out, safe_serialization=True)
        for name in os.listdir(out):  # durable, as ours
            fd = os.open(os.path.join(out, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    else:
        from shardgather.__main__ import main
        args = ["consolidate", src, os.path.join(out, "model.safetensors"), "--no-progress"]
        if method == "sg-1":
            args += ["--workers", "1"]
        assert main(args) == 0
    elapsed = time.perf_counter() - t
print(json.dumps({"time_s": elapsed, "peak_rss_rise": m["peak_rise"]}))
"""


def _run(method: str, src: str, out: str) -> dict:
    return run_child(_CHILD, method, src, out)


def _same(a: str, b: str) -> bool:
    """Two safetensors files hold the same tensors, bit for bit (read a tensor at a
    time: neither output is held whole)."""
    from safetensors import safe_open

    with safe_open(a, "pt") as fa, safe_open(b, "pt") as fb:
        if set(fa.keys()) != set(fb.keys()):
            return False
        return all(torch.equal(fa.get_tensor(k), fb.get_tensor(k)) for k in fa.keys())  # noqa: SIM118 (safe_open)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=1.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", default=None, help="reuse (or create) the checkpoint here")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="sg-deepspeed-", dir=os.environ.get("SG_BENCH_DIR"))
    try:
        src = args.keep or os.path.join(root, "ckpt")
        if not os.path.isfile(os.path.join(src, "latest")):
            t = time.perf_counter()
            run_ranks(save_worker, 2, args.size_gb, src)
            print(f"DeepSpeed ZeRO-3 checkpoint written in {time.perf_counter() - t:.0f} s")
        ckpt_bytes = sum(
            os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(src) for n in ns
        )
        outs = {m: os.path.join(root, m) for m in ("sg", "sg-1", "zero_to_fp32")}
        labels = {
            "sg": "shardgather consolidate -> one safetensors, fsync'ed",
            "sg-1": "shardgather consolidate --workers 1",
            "zero_to_fp32": "DeepSpeed zero_to_fp32 (safe_serialization=True) + fsync",
        }
        times: dict[str, list[float]] = {m: [] for m in outs}
        rss: dict[str, list[int]] = {m: [] for m in outs}
        first: dict[str, float] = {}
        order = list(outs)
        for r in range(args.repeats + 1):  # round 0: the first call of each, reported apart
            for m in order if r % 2 == 0 else order[::-1]:
                shutil.rmtree(outs[m], ignore_errors=True)
                os.makedirs(outs[m])
                evict([src])
                res = _run(m, src, outs[m])
                if r == 0:
                    first[m] = res["time_s"]
                    continue
                times[m].append(res["time_s"])
                rss[m].append(res["peak_rss_rise"])
        ours = os.path.join(outs["sg"], "model.safetensors")
        verified = {
            "sg": _same(ours, os.path.join(outs["zero_to_fp32"], "model.safetensors")),
            "sg-1": _same(ours, os.path.join(outs["sg-1"], "model.safetensors")),
        }
        verified["zero_to_fp32"] = verified["sg"]
        size = os.path.getsize(ours) / 2**30
        base = statistics.median(times["sg"])
        print(
            f"\n{size:.2f} GiB of fp32 weights from a 2-rank ZeRO-3 checkpoint of "
            f"{ckpt_bytes / 2**30:.2f} GiB, median of {args.repeats}, alternated, cold cache"
        )
        print(f"{'method':66} first s  time s  x sg  peak RSS rise MiB  bit-exact")
        results = []
        for m in outs:
            t = statistics.median(times[m])
            peak = max(rss[m])
            print(
                f"{labels[m]:66} {first[m]:7.2f} {t:7.2f} {t / base:5.2f} {peak / MiB:18.0f}"
                f"  {verified[m]}"
            )
            results.append(
                {
                    "method": labels[m],
                    "time_s": t,
                    "times_s": times[m],
                    "first_call_s": first[m],
                    "time_ratio_vs_shardgather": t / base,
                    "peak_rss_rise": peak,
                    "peak_rss_rises": rss[m],
                    "verified": verified[m],
                }
            )
        write_json(
            args.json,
            "bench_deepspeed.py",
            args,
            weights_gib=size,
            checkpoint_gib=ckpt_bytes / 2**30,
            cache="evicted before every run (drop_caches, else POSIX_FADV_DONTNEED)",
            results=results,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
