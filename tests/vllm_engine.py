"""A real vLLM engine receiving shardgather weight syncs: run by tests/test_vllm.py and
bench/bench_vllm_sync.py with the vLLM venv's python (scripts/vllm_env.sh), never in
a trainer's process (vLLM claims the process's default group).

It plays the RL controller's part too: every step it drives vLLM's four phases through
``collective_rpc`` (each with a timeout), then generates greedily from token ids, and
appends one JSON line per event to ``--out`` (flushed: a parent reads it as it goes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--trainers", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", default="[[1, 2, 3, 4, 5]]")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--die-in-step", type=int, default=-1)
    ap.add_argument("--generate", type=int, default=1)
    args = ap.parse_args()
    out = open(args.out, "a", buffering=1)  # noqa: SIM115 - one line per event

    def emit(**event: object) -> None:
        event["at"] = time.time()
        event["rss_mib"] = _rss_mib()
        out.write(json.dumps(event) + "\n")

    try:
        import torch
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        from shardgather.integrations import vllm as sg_vllm

        sg_vllm.register()
        llm = LLM(
            model=args.model,
            skip_tokenizer_init=True,
            kv_cache_memory_bytes=64 << 20,
            enforce_eager=True,
            dtype=args.dtype,
            max_model_len=256,
            weight_transfer_config={"backend": sg_vllm.BACKEND},
        )
        prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(args.prompts)]
        greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)

        def generate() -> list[list[int]]:
            if not args.generate:
                return []
            return [
                list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)
            ]

        emit(event="up", tokens=generate(), torch=torch.__version__)
        t = args.timeout
        info = {"host": "127.0.0.1", "port": args.port, "trainers": args.trainers, "timeout_s": t}
        llm.collective_rpc("init_weight_transfer_engine", timeout=t, kwargs={"init_info": info})
        emit(event="joined")
        for step in range(args.steps):
            if step == args.die_in_step:
                # Die in the middle of a sync: the trainers are sending (the first
                # message arrived), nothing has been applied.
                worker = llm.llm_engine.model_executor.driver_worker.worker
                receiver = worker.weight_transfer_engine.receiver
                real = receiver.wire.get_header

                def die(src: int, real=real) -> list[int]:  # type: ignore[no-untyped-def]
                    got = real(src)
                    os._exit(3)
                    return got

                receiver.wire.get_header = die
            t0 = time.perf_counter()
            try:
                llm.collective_rpc("start_weight_update", timeout=t)
                llm.collective_rpc("update_weights", timeout=t, kwargs={"update_info": {}})
                llm.collective_rpc("finish_weight_update", timeout=t)
            except Exception as exc:
                emit(
                    event="failed",
                    step=step,
                    error=f"{type(exc).__name__}: {exc}",
                    tokens=generate(),
                )
                continue
            served = time.perf_counter() - t0
            (last,) = llm.collective_rpc(sg_vllm.last_update, timeout=t)
            emit(event="synced", step=step, served_s=served, last=last, tokens=generate())
        emit(event="done")
    except BaseException:
        emit(event="crashed", error=traceback.format_exc())
    finally:
        out.flush()
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
