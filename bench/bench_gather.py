"""shardgather vs torch's own full-state-dict paths, same model, same run.

    python bench/bench_gather.py --size-gb 1 --world 2 [--backend gloo|nccl]
        [--ops gather save load optim] [--methods SUBSTR ...] [--hosts aabb] [--json out.json]

Spawns W processes, builds a GPT-like fp32 model of S GiB (tied embedding), shards it
with FSDP1 and with FSDP2, and for every method reports the median wall time of
--repeats runs after a warm-up, throughput, the peak host RSS rise of every rank
(kernel high-water mark), peak device memory on CUDA, and the ratio to shardgather.
shardgather's result is checked bit-exactly against torch's on rank 0: a fast wrong
answer is a failure.
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
import torch.multiprocessing as mp
from torch import nn

from shardgather._memory import peak_rss_rise, trim
from shardgather.testing import Block, build_gpt


def _nbytes(sd: dict) -> int:
    if "state" in sd and "param_groups" in sd:  # an optimizer state dict
        return sum(_nbytes(st) for st in sd["state"].values())
    seen, total = set(), 0
    for v in sd.values():
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            continue
        if v.data_ptr() not in seen:
            seen.add(v.data_ptr())
            total += v.numel() * v.element_size()
    return total


def _same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k].cpu()) for k in b)


def _methods(kind: str, model: nn.Module, files: str, ops: set[str], ref_sd: dict) -> dict:
    """name -> (run, verify): run() returns a state dict or None; verify(result, ref)
    checks it against shardgather's full_state_dict on rank 0 (None: not checked)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    import shardgather as sg

    rank = dist.get_rank()
    st_path, pt_path = f"{files}/{kind}.safetensors", f"{files}/{kind}.pt"

    def same(got: dict, ref: dict) -> bool:
        return _same(ref, got) if rank == 0 else True

    def gathered_equal(_: object, ref: dict) -> bool:
        got = sg.full_state_dict(model)
        return _same(ref, got) if rank == 0 else True

    def file_equal(_: object, ref: dict) -> bool:
        return _same(ref, sg.load_file(st_path)) if rank == 0 else True

    def torch_full() -> dict:
        if kind == "fsdp1":
            from torch.distributed.fsdp import FullStateDictConfig, StateDictType
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
                return model.state_dict()
        return get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def torch_save() -> None:
        sd = torch_full()
        if rank == 0:
            torch.save(sd, pt_path)
        dist.barrier()

    def torch_save_safetensors() -> None:
        sd = torch_full()
        if rank == 0:
            from safetensors.torch import save_file

            # safetensors refuses shared tensors: store the tied weight once.
            save_file({k: v for k, v in sd.items() if k != "lm_head.weight"}, st_path + ".t")
        dist.barrier()

    def torch_load_every_rank() -> None:
        sd = torch.load(pt_path, mmap=False, weights_only=True)
        if kind == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp import StateDictType

            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
                model.load_state_dict(sd)
        else:
            set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True))

    def torch_broadcast_from_rank0() -> None:
        sd = torch.load(pt_path, mmap=False, weights_only=True) if rank == 0 else {}
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, sd, options=opts)

    out: dict = {}
    if "optim" in ops and kind == "fsdp2":
        # One AdamW step so that the state exists (2x the model). FSDP2 only: on FSDP1
        # torch's CPU path returns exp_avg == exp_avg_sq (DESIGN.md section 5).
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for p in model.parameters():
            p.grad = torch.ones_like(p) * 1e-3
        opt.step()
        opt.zero_grad(set_to_none=True)

        def optim_same(got: dict, ref: dict) -> bool:
            mine = sg.full_optim_state_dict(model, opt)  # collective: every rank
            if rank != 0:
                return True
            return all(
                torch.equal(mine["state"][k][n], v)
                for k, st in got["state"].items()
                for n, v in st.items()
                if isinstance(v, torch.Tensor) and v.dim() > 0
            )

        out["optim: shardgather"] = (lambda: sg.full_optim_state_dict(model, opt), None)
        out["optim: torch get_optimizer_state_dict"] = (
            lambda: get_optimizer_state_dict(
                model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            ),
            optim_same,
        )
    if "gather" in ops:
        out["gather: shardgather"] = (lambda: sg.full_state_dict(model), same)
        out["gather: shardgather, transport=collective"] = (
            lambda: sg.full_state_dict(model, transport="collective"),
            same,
        )
        if kind == "fsdp1":
            out["gather: torch FSDP1 FULL_STATE_DICT"] = (torch_full, same)
        out["gather: torch get_model_state_dict"] = (
            lambda: get_model_state_dict(
                model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            ),
            same,
        )
    if "save" in ops:
        out["save: shardgather -> safetensors"] = (
            lambda: sg.save_full_state_dict(model, st_path),
            file_equal,
        )
        out["save: torch full sd + torch.save"] = (torch_save, None)
        floor_buf = torch.ones(_nbytes(ref_sd) if rank == 0 else 0, dtype=torch.uint8)
        out["save: floor: rank 0 writes the same bytes once + fsync"] = (
            lambda: _sequential_write(f"{files}/floor.bin", floor_buf),
            None,
        )
        out["save: torch full sd + safetensors"] = (torch_save_safetensors, None)
    if "load" in ops:
        out["load: shardgather <- safetensors"] = (
            lambda: sg.load_full_state_dict(model, st_path),
            gathered_equal,
        )
        out["load: torch.load every rank + load_state_dict"] = (
            torch_load_every_rank,
            gathered_equal,
        )
    if "load" in ops and kind == "fsdp2":
        # torch 2.14 on FSDP1 with tied weights: non-zero ranks raise "Missing key(s):
        # lm_head.weight" in set_model_state_dict(broadcast_from_rank0=True).
        out["load: torch set_model_state_dict(broadcast_from_rank0)"] = (
            torch_broadcast_from_rank0,
            gathered_equal,
        )
    return out


def _sequential_write(path: str, buf: torch.Tensor) -> None:
    """The disk's floor for a save: one ready buffer, one sequential write, fsync."""
    if buf.numel():
        with open(path, "wb") as f:
            f.write(memoryview(buf.numpy()))
            f.flush()
            os.fsync(f.fileno())
        os.unlink(path)
    dist.barrier()


def _shard(kind: str, model: nn.Module, device: torch.device, world: int) -> nn.Module:
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _measure(name: str, fn, verify, ref_sd: dict, repeats: int, nccl: bool) -> dict:  # type: ignore[no-untyped-def]
    """Run once (warm-up, verified), then ``repeats`` timed runs with peak RSS."""
    times, peaks, shm_peaks, gpu_peaks = [], [], [], []
    result: dict = {}
    nbytes = 0
    for it in range(repeats + 1):
        dist.barrier()
        if nccl:
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
        with peak_rss_rise() as mem:
            t0 = time.perf_counter()
            out = fn()
            if nccl:
                torch.cuda.synchronize()
            dist.barrier()
            dt = time.perf_counter() - t0
        if isinstance(out, dict) and out:
            nbytes = _nbytes(out)
        if it == 0:
            result["verified"] = None if verify is None else bool(verify(out, ref_sd))
        else:
            times.append(dt)
            peaks.append(mem["peak_rise"])
            shm_peaks.append(mem["shm_rise"])
            if nccl:
                gpu_peaks.append(torch.cuda.max_memory_allocated())
        del out
        trim()
    result.update(
        time_s=statistics.median(times),
        times_s=times,
        peak_rss_rise=max(peaks),
        peak_shm_rise=max(shm_peaks),
        out_bytes=nbytes or _nbytes(ref_sd) if ref_sd else nbytes,
    )
    if nccl:
        result["peak_gpu_allocated"] = max(gpu_peaks)
    return result


def worker(rank: int, world: int, args: argparse.Namespace, tmp: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    if args.hosts:
        # Pretend ranks live on several hosts: those off rank 0's send their pieces.
        os.environ["SHARDGATHER_HOST_ID"] = "host-" + args.hosts[rank]
    nccl = args.backend == "nccl"
    if nccl:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if nccl else torch.device("cpu")
    dist.init_process_group(
        args.backend,
        init_method=f"file://{tmp}/rdzv",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(minutes=20),
    )
    results: dict = {}
    try:
        import shardgather as sg

        for kind in args.fsdp:
            model = _shard(kind, build_gpt(args.size_gb, device), device, world)
            trim()
            # The reference every method is checked against (kept on rank 0 only).
            ref_sd = sg.full_state_dict(model)
            for name, (fn, verify) in _methods(kind, model, tmp, set(args.ops), ref_sd).items():
                if args.methods and not any(m in name for m in args.methods):
                    continue
                results[f"{kind}/{name}"] = _measure(name, fn, verify, ref_sd, args.repeats, nccl)
                if rank == 0:
                    r = results[f"{kind}/{name}"]
                    print(f"  {kind}/{name}: {r['time_s']:.3f} s", file=sys.stderr, flush=True)
            del model, ref_sd
            trim()
    except BaseException:
        import traceback

        results = {"__error__": traceback.format_exc()}
    torch.save(results, f"{tmp}/rank{rank}.pt")
    try:
        dist.destroy_process_group()
    finally:
        os._exit(0)


def _rows(per_rank: list[dict]) -> list[dict]:
    rows = []
    for key, r0 in per_rank[0].items():
        kind, name = key.split("/", 1)
        op = name.split(":")[0]
        base = per_rank[0].get(
            next((k for k in per_rank[0] if k.startswith(f"{kind}/{op}: shardgather")), "")
        )
        rows.append(
            {
                "method": key,
                "time_s": r0["time_s"],
                "gb_per_s": r0["out_bytes"] / r0["time_s"] / 1e9 if r0["time_s"] else None,
                "out_bytes": r0["out_bytes"],
                "peak_rss_rise_per_rank": [pr[key]["peak_rss_rise"] for pr in per_rank],
                "peak_shm_rise_node": r0["peak_shm_rise"],
                "peak_gpu_allocated_per_rank": [
                    pr[key].get("peak_gpu_allocated") for pr in per_rank
                ],
                "verified": r0.get("verified"),
                "time_ratio_vs_shardgather": r0["time_s"] / base["time_s"] if base else None,
                "times_s": r0["times_s"],
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument(
        "--hosts",
        default="",
        help="one letter per rank, e.g. aabb: pretend ranks run on several hosts "
        "(SHARDGATHER_HOST_ID), so ranks off rank 0's host send their pieces to it",
    )
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--fsdp", nargs="+", default=["fsdp1", "fsdp2"], choices=["fsdp1", "fsdp2"])
    ap.add_argument(
        "--ops",
        nargs="+",
        default=["gather", "save", "load"],
        choices=["gather", "save", "load", "optim"],
    )
    ap.add_argument("--methods", nargs="*", default=None, help="substrings of method names")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.hosts and len(args.hosts) != args.world:
        ap.error(f"--hosts needs one letter per rank ({args.world}), got {args.hosts!r}")

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="sg-bench-") as tmp:
        procs = [
            ctx.Process(target=worker, args=(r, args.world, args, tmp)) for r in range(args.world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        per_rank, errors = [], []
        for r in range(args.world):
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

    rows = _rows(per_rank)
    print(
        f"\nmodel {args.size_gb} GiB fp32 (tied GPT), world {args.world}, {args.backend}, "
        + (f"pretend hosts {args.hosts}, " if args.hosts else "")
        + f"median of {args.repeats} after a verified warm-up; time/sg = time / shardgather's"
    )
    print(
        f"{'method':64} {'time s':>7} {'GB/s':>5} {'time/sg':>7} "
        f"{'peak RSS rise MiB/rank':>23} {'+shm MiB':>8} verified"
    )
    for r in rows:
        rss = " / ".join(f"{x / 2**20:.0f}" for x in r["peak_rss_rise_per_rank"])
        ratio = r["time_ratio_vs_shardgather"]
        print(
            f"{r['method']:64} {r['time_s']:7.3f} {r['gb_per_s']:5.2f} "
            f"{ratio if ratio is not None else float('nan'):7.2f} {rss:>23} "
            f"{r['peak_shm_rise_node'] / 2**20:8.0f} {r['verified']}"
        )
    import shardgather

    report = {
        "config": vars(args),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if args.backend == "nccl" else None,
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
    bad = [r["method"] for r in rows if r["verified"] is False]
    if bad:
        sys.exit(f"results differ from shardgather's: {bad}")


if __name__ == "__main__":
    main()
