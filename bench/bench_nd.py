"""A 2-D model (FSDP2 over dp x tensor parallel over tp, world 4): gather, save as a
sharded Hugging Face directory and load it back, shardgather vs torch's own paths and
vs torch-checkpointing (Meta's DTensor-aware checkpoint library torchtitan depends on),
in the same run.

    python bench/bench_nd.py --size-gb 1 --world 4 [--repeats 3] [--shard-mb 256] [--json out.json]

The model: ``shardgather.testing.build_gpt`` laid out by ``parallelize_gpt`` (qkv/fc1
column-wise, proj/fc2 row-wise over tp, FSDP2 over dp: ``(_StridedShard, Shard)`` and
``(Shard(0), Shard(1))`` placements; the tied embedding over dp only).

gather
  - ``full_state_dict(model)`` (rank 0 gets the dict)
  - ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``
save (a fresh HF directory each time, the same split of files for all)
  - ``save_full_state_dict(model, dir, max_shard_size=...)``
  - torch-checkpointing: ``CheckpointManager`` sync save of ``get_model_state_dict``
    (each rank's safetensors + metadata.pkl), then ``consolidate_hf_safetensors_checkpoint``
    into the HF files (the time is both)
  - ``get_model_state_dict(full, cpu_offload)`` + ``save_torch_state_dict`` on rank 0
load (page cache dropped before each, the same directory)
  - ``load_full_state_dict(model, dir)``
  - torch-checkpointing ``CheckpointManager.load(dir, {"model": get_model_state_dict(model)},
    metadata_format=HuggingFaceSafetensorsDistributedMetadataFormat)``
  - torch's ``set_model_state_dict`` of a full dict is tried once and reported (on torch
    2.14 it asserts on FSDP's ``_StridedShard``).

torch-checkpointing 0.1.1 needs three workarounds on this CPU machine (DESIGN §5), all
applied here: ``LocalFileSystemStorageConfig(use_direct_io=False)`` (its O_DIRECT writes
are unaligned: EINVAL on ext4); its metadata all-gather, hard-wired to ``cuda``, replaced
by ``dist.all_gather_object``; a fresh ``CheckpointManager`` per save (a manager's second
sync save skips ``metadata.pkl``); plus a barrier after its save (rank 0 publishes the
directory; the others would consolidate before it exists).

Methods alternate (A B C, C B A, ...), the first round is a warm-up; medians, the slowest
rank's peak RSS rise per rank (kernel high-water mark); every result is checked
bit-exactly once against the model's full state dict.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from _ranks import drop_caches, method_rows, run_ranks, timed
from bench_hf_save import _check

from shardgather.testing import build_gpt, parallelize_gpt

MiB = 2**20


def _torch_checkpointing_on_cpu() -> None:
    """Workaround 2: the metadata all-gather of torch-checkpointing 0.1.1 puts its tensors
    on "cuda"; the same exchange through gloo's object all-gather."""
    import torch_checkpointing.metadata_manager as mm

    def all_gather_pickled(self, data, process_group=None):  # type: ignore[no-untyped-def]
        out: list = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(out, data, group=process_group)
        return dict(enumerate(out))

    for cls in vars(mm).values():
        if isinstance(cls, type) and "_all_gather_pickled_data" in vars(cls):
            cls._all_gather_pickled_data = all_gather_pickled


def worker(rank: int, world: int, args: argparse.Namespace, root: str) -> dict:
    import faulthandler

    from huggingface_hub import save_torch_state_dict
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch_checkpointing import CheckpointManager, ItemSpec
    from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
    from torch_checkpointing.config import SyncCheckpointSaverConfig
    from torch_checkpointing.default_resharder import DefaultResharder
    from torch_checkpointing.hf.consolidation import consolidate_hf_safetensors_checkpoint
    from torch_checkpointing.hf.metadata import (
        HuggingFaceSafetensorsDistributedMetadataFormat as HFFormat,
    )
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    import shardgather as sg
    from shardgather._engine.sinks import file_set
    from shardgather._plan import build_plan

    faulthandler.dump_traceback_later(1800, exit=True)  # a hang ends the bench
    _torch_checkpointing_on_cpu()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_gpt(build_gpt(args.size_gb), mesh)
    placements = sorted({str(p.placements) for p in model.parameters()})
    want = sg.full_state_dict(model)  # {} except on rank 0
    shard = args.shard_mb * 10**6
    plan = build_plan(model)
    fs = file_set(plan, os.path.join(root, "x"), max_shard_size=shard)
    mapping = {k: fs.where[k][0] + 1 for k in fs.where}
    tied = set(plan.aliases)
    storage = LocalFileSystemStorageConfig(use_direct_io=False)  # workaround 1
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def sharded_sd() -> dict:  # type: ignore[type-arg]
        return {k: v for k, v in get_model_state_dict(model).items() if k not in tied}

    def manager() -> CheckpointManager:  # workaround 3: a fresh one for every save
        spec = ItemSpec(
            requires_copy=False,
            resharder=DefaultResharder(),
            layout=LayoutInfo("model_{rank}.safetensors", SafetensorsSerialization()),
        )
        return CheckpointManager(
            CheckpointManager.Config(
                items={"model": spec}, save=SyncCheckpointSaverConfig(), storage_config=storage
            )
        )

    stats: dict = {}
    verified: dict = {}

    def new(names: list[str]) -> None:
        for n in names:
            stats[n] = {"times": [], "rss": [], "cold": []}

    # ------------------------------------------------------------------ gather
    got: dict = {}

    def g_ours(run: int) -> None:
        got[run] = sg.full_state_dict(model)

    def g_torch(run: int) -> None:
        got[run] = get_model_state_dict(model, options=full)

    def g_check(name: str, run: int) -> None:
        sd = got.pop(run)
        if rank == 0 and name not in verified:
            verified[name] = all(torch.equal(sd[k], want[k]) for k in want)
        del sd

    gather = {
        "gather: shardgather full_state_dict": g_ours,
        "gather: torch get_model_state_dict(full_state_dict, cpu_offload)": g_torch,
    }
    new(list(gather))
    timed(stats, gather, args.repeats, after=g_check)

    # -------------------------------------------------------------------- save
    def s_ours(run: int) -> None:
        sg.save_full_state_dict(model, os.path.join(root, f"s{run}"), max_shard_size=shard)

    def s_tc(run: int) -> None:
        d = os.path.join(root, f"s{run}")
        manager().save(d + ".sharded", {"model": sharded_sd()})
        dist.barrier()  # rank 0 publishes the directory
        consolidate_hf_safetensors_checkpoint(
            d + ".sharded", output_dir=d, fqn_to_index_mapping=mapping, storage_config=storage
        )

    def s_torch(run: int) -> None:
        sd = get_model_state_dict(model, options=full)
        if rank == 0:
            d = os.path.join(root, f"s{run}")
            os.makedirs(d)
            save_torch_state_dict(sd, d, max_shard_size=shard)
        del sd

    def s_check(name: str, run: int) -> None:
        d = os.path.join(root, f"s{run}")
        if rank == 0:
            if name not in verified:
                verified[name] = _check(d, want)
            shutil.rmtree(d)
            shutil.rmtree(d + ".sharded", ignore_errors=True)

    save = {
        "HF save: shardgather save_full_state_dict (fsync'ed)": s_ours,
        "HF save: torch-checkpointing sharded save + consolidate_hf_safetensors_checkpoint": s_tc,
        "HF save: torch get_model_state_dict(full) + save_torch_state_dict on rank 0": s_torch,
    }
    new(list(save))
    timed(stats, save, args.repeats, after=s_check)

    # -------------------------------------------------------------------- load
    src = os.path.join(root, "load-src")
    sg.save_full_state_dict(model, src, max_shard_size=shard)

    def zero() -> bool:
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().zero_()
        cold = [drop_caches() if rank == 0 else False]
        dist.broadcast_object_list(cold, src=0)
        return bool(cold[0])

    def l_ours(run: int) -> None:
        sg.load_full_state_dict(model, src)

    def l_tc(run: int) -> None:
        sd = sharded_sd()
        # The HF format is not rank addressable: the item needs its resharder to load
        cfg = CheckpointManager.Config(
            items={"model": ItemSpec(resharder=DefaultResharder())}, storage_config=storage
        )
        CheckpointManager(cfg).load(src, {"model": sd}, metadata_format=HFFormat)

    def l_check(name: str, run: int) -> None:
        sd = sg.full_state_dict(model)
        if rank == 0:
            ok = all(torch.equal(sd[k], want[k]) for k in want)
            verified[name] = ok and verified.get(name, True)

    load = {
        "load (cold cache): shardgather load_full_state_dict <- HF directory": l_ours,
        "load (cold cache): torch-checkpointing CheckpointManager.load <- HF directory": l_tc,
    }
    new(list(load))
    timed(stats, load, args.repeats, before=zero, after=l_check)

    # torch's own full-dict load, once: does it take a 2-D model at all?
    try:
        set_model_state_dict(
            model,
            want if rank == 0 else {},
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
        torch_load = "ok"
    except Exception as exc:
        torch_load = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    return {
        "stats": stats,
        "verified": verified,
        "files": len(fs.names),
        "placements": placements,
        "set_model_state_dict": torch_load,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shard-mb", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.world % 2:
        sys.exit("--world must be even (tp = 2)")
    with tempfile.TemporaryDirectory(prefix="sg-bench-nd-", dir=".") as root:
        per_rank = run_ranks(worker, args.world, args, os.path.abspath(root))
    r0 = per_rank[0]
    rows = method_rows(per_rank)
    for row in rows:
        section = row["method"].split(":")[0]
        row["cold_cache"] = all(r0["stats"][row["method"]]["cold"]) if "load" in section else None
    print(
        f"\n{args.size_gb} GiB tied GPT, dp {args.world // 2} x tp 2 (FSDP2 x TP), gloo, "
        f"world {args.world}, {r0['files']} files of <= {args.shard_mb} MB, median of "
        f"{args.repeats}, methods alternated\nplacements: {', '.join(r0['placements'])}"
    )
    print(f"{'method':84} {'time s':>7} {'x sg':>6} {'RSS rise MiB/rank':>22} ok")
    for r in rows:
        rss = " / ".join(f"{x / MiB:.0f}" for x in r["peak_rss_rise_per_rank"])
        print(
            f"{r['method']:84} {r['time_s']:7.3f} {r['time_ratio_vs_shardgather']:6.2f} "
            f"{rss:>22} {r['verified']}"
        )
    print(f"torch set_model_state_dict(full, broadcast_from_rank0): {r0['set_model_state_dict']}")
    import shardgather

    report = {
        "config": vars(args),
        "files": r0["files"],
        "placements": r0["placements"],
        "set_model_state_dict": r0["set_model_state_dict"],
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
