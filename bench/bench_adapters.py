"""LoRA under FSDP2 (2 ranks): the adapter alone and the merged model, shardgather vs
what the Hugging Face stack does (Accelerate's FSDP path under the Trainer: the full
state dict gathered, then PEFT picks the adapter / merges on one rank), in one run.

    python bench/bench_adapters.py --size-gb 1 [--rank 16] [--repeats 3] [--json out.json]

The model: a transformers Llama of about ``--size-gb`` GiB fp32 (hidden 1024, MLP 2816,
vocab 32000), LoRA of rank ``--rank`` on every linear layer of every block; FSDP2 on
each block and the root.

adapter (PEFT's format: adapter_model.safetensors + adapter_config.json)
  - ``shardgather.save_adapter(model, dir)``
  - ``get_model_state_dict(full_state_dict, cpu_offload)``, then PEFT's
    ``save_pretrained(state_dict=...)`` on rank 0 (which picks the adapter out)
merged (a from_pretrained-able directory of the base architecture)
  - ``shardgather.save_full_state_dict(model, dir, merge_adapter="default")``
  - ``get_model_state_dict(full, cpu_offload)`` into a plain PeftModel on rank 0,
    ``merge_and_unload()``, ``save_pretrained`` (rank 0 holds the full model twice)

Per method: median time (methods alternated, the first round a warm-up), each rank's
peak RSS rise, and what each rank moved and wrote (shardgather's own byte counters and
/proc/self/io write_bytes). Every output is checked bit-exactly once against PEFT on
the unsharded model (the adapter) and ``merge_and_unload`` (the merged weights).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import tempfile

import torch
import torch.distributed as dist
from _ranks import method_rows, run_ranks, timed

MiB = 2**20
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _written() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("write_bytes")).split()[1])


def _model(size_gb: float, rank_r: int):  # type: ignore[no-untyped-def]
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    d, ff, vocab = 1024, 2816, 32000
    per_layer = 4 * d * d + 3 * d * ff + 2 * d
    layers = max(1, round((size_gb * 2**30 / 4 - 2 * vocab * d) / per_layer))
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=ff,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    lora = LoraConfig(r=rank_r, lora_alpha=2 * rank_r, target_modules=TARGETS)
    lora.init_lora_weights = False  # non-zero B: a trained adapter's values
    return get_peft_model(base, lora), config


def worker(rank: int, world: int, args: argparse.Namespace, root: str) -> dict:
    import faulthandler

    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    import shardgather as sg
    from shardgather import _dist

    faulthandler.dump_traceback_later(args.hang_s, exit=True)  # a hang ends the bench
    if os.environ.get("SG_BENCH_TRACE"):
        import signal

        faulthandler.register(signal.SIGUSR1, all_threads=True)
    pm, config = _model(args.size_gb, args.rank)
    plain = copy.deepcopy(pm) if rank == 0 else None  # the peers' rank-0 model, and the oracle
    for layer in pm.base_model.model.model.layers:
        fully_shard(layer)
    model = fully_shard(pm)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    want_adapter = get_peft_model_state_dict(plain) if rank == 0 else {}
    want_merged = copy.deepcopy(plain).merge_and_unload().state_dict() if rank == 0 else {}
    adapter_bytes = sum(t.numel() * t.element_size() for t in want_adapter.values())
    model_bytes = sum(p.numel() * p.element_size() for p in pm.parameters())

    stats: dict = {}
    verified: dict = {}
    moved: dict = {}

    def counted(methods: dict) -> dict:  # type: ignore[type-arg]
        """The methods, each recording what its rank moved and wrote under its name."""
        for name in methods:
            stats[name] = {"times": [], "rss": [], "cold": []}
        return {name: _counted(name, fn) for name, fn in methods.items()}

    def _counted(name: str, fn):  # type: ignore[no-untyped-def]
        def run(i: int) -> None:
            if os.environ.get("SG_BENCH_TRACE"):
                print(f"rank {rank}: {name} run {i}", flush=True)
            r0, s0, w0 = _dist.STATS["bytes_received"], _dist.STATS["bytes_sent"], _written()
            fn(i)
            moved[name] = {
                "received": _dist.STATS["bytes_received"] - r0,
                "sent": _dist.STATS["bytes_sent"] - s0,
                "written": _written() - w0,
            }

        return run

    def out(i: int) -> str:
        return os.path.join(root, f"o{i}")

    # ------------------------------------------------------------------ adapter
    def a_ours(i: int) -> None:
        sg.save_adapter(model, out(i))

    def a_peer(i: int) -> None:
        sd = get_model_state_dict(model, options=full)
        if rank == 0:  # PEFT picks the adapter out of the full dict (what the Trainer does)
            plain.save_pretrained(out(i), state_dict=sd)
        del sd

    def a_check(name: str, i: int) -> None:
        if rank == 0:
            if name not in verified:
                got = load_file(os.path.join(out(i), "adapter_model.safetensors"))
                verified[name] = sorted(got) == sorted(want_adapter) and all(
                    torch.equal(got[k], v) for k, v in want_adapter.items()
                )
            shutil.rmtree(out(i))

    adapter = counted(
        {
            "adapter: shardgather save_adapter": a_ours,
            "adapter: get_model_state_dict(full) + PEFT save_pretrained(state_dict) on rank 0": (
                a_peer
            ),
        }
    )
    timed(stats, adapter, args.repeats, after=a_check)

    # ------------------------------------------------------------------- merged
    def m_ours(i: int) -> None:
        files = {"config.json": config.to_dict()}  # what save_pretrained writes beside
        sg.save_full_state_dict(model, out(i) + "/", merge_adapter="default", files=files)

    def m_peer(i: int) -> None:
        sd = get_model_state_dict(model, options=full)
        if rank == 0:
            peft_copy = copy.deepcopy(plain)
            peft_copy.load_state_dict(sd)
            peft_copy.merge_and_unload().save_pretrained(out(i))
            del peft_copy
        del sd

    def m_check(name: str, i: int) -> None:
        if rank == 0:
            if name not in verified:
                got = LlamaForCausalLM.from_pretrained(out(i)).state_dict()
                verified[name] = sorted(got) == sorted(want_merged) and all(
                    torch.equal(got[k], v) for k, v in want_merged.items()
                )
            shutil.rmtree(out(i))

    merged = counted(
        {
            "merged: shardgather save_full_state_dict(merge_adapter=)": m_ours,
            "merged: get_model_state_dict(full) + merge_and_unload + save_pretrained on rank 0": (
                m_peer
            ),
        }
    )
    timed(stats, merged, args.repeats, after=m_check)
    dist.barrier()
    return {
        "stats": stats,
        "verified": verified,
        "moved": moved,
        "adapter_bytes": adapter_bytes,
        "model_bytes": model_bytes,
        "layers": config.num_hidden_layers,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--hang-s", type=int, default=1800, help="a rank stuck this long dumps and exits"
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sg-bench-lora-", dir=".") as root:
        per_rank = run_ranks(worker, args.world, args, os.path.abspath(root))
    r0 = per_rank[0]
    rows = method_rows(per_rank)
    for row in rows:
        row["bytes_per_rank"] = [pr["moved"][row["method"]] for pr in per_rank]
    print(
        f"\n{args.size_gb} GiB Llama ({r0['layers']} layers), LoRA r={args.rank} on every "
        f"linear: adapter {r0['adapter_bytes'] / MiB:.1f} MiB of {r0['model_bytes'] / MiB:.0f} "
        f"MiB; FSDP2, gloo, world {args.world}, median of {args.repeats}, methods alternated"
    )
    print(
        f"{'method':92} {'time s':>7} {'x sg':>6} {'RSS MiB/rank':>14} {'MiB recv/written per rank':>28} ok"
    )
    for r in rows:
        rss = " / ".join(f"{x / MiB:.0f}" for x in r["peak_rss_rise_per_rank"])
        io = " / ".join(
            f"{b['received'] / MiB:.1f},{b['written'] / MiB:.1f}" for b in r["bytes_per_rank"]
        )
        print(
            f"{r['method']:92} {r['time_s']:7.3f} {r['time_ratio_vs_shardgather']:6.2f} "
            f"{rss:>14} {io:>28} {r['verified']}"
        )
    report = {
        "config": vars(args),
        "adapter_bytes": r0["adapter_bytes"],
        "model_bytes": r0["model_bytes"],
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
