"""Weight sync into an inference process: packed full syncs and delta syncs vs the
per-tensor ways, in the same run.

    python bench/bench_weight_sync.py --size-gb 1 [--repeats 3] [--json out.json]

Two FSDP2 trainer ranks (gloo) hold the tied GPT of ``shardgather.testing``; one more
process, the "inference worker", holds two plain bf16 copies and joins two sync groups
(``connect_sync_group``): one with both trainer ranks (direct: each sends its own
pieces), one with trainer rank 0 alone (relayed; the per-tensor ways use it too).
Everything is sent as bf16. Full syncs, alternated (A B C D, D C B A, ...), medians
after a warm-up:

- ``WeightSender.sync(full=True)``, direct: every rank's own pieces, cast into what it
  keeps as sent, straight into the worker's tensors;
- ``WeightSender.sync(full=True)``, relayed: packed buckets gathered to rank 0, one
  message each;
- ``Gatherer.iter_full_tensors`` (bf16) + one broadcast per tensor (what RL stacks do
  with a streaming gatherer);
- ``get_model_state_dict(full_state_dict, cpu_offload)`` + a cast and one broadcast per
  tensor (what they do without one).

Then delta syncs (``WeightSender.sync()``, direct and relayed, alternated) after the
bench changed a set fraction of the bf16 values (0.5 %, 2 %, 10 %: each trainer rank
bumps that many of its own elements by one bf16 step, once for both senders). After every timed sync the worker's weights are checked
against the trainer's (an exact digest of every bf16 tensor). Reported: time, bytes on
the wire, each trainer rank's peak RSS rise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _ranks import run_ranks, write_json

import shardgather as sg
from shardgather._memory import peak_rss_rise

MiB = 2**20
STOP, PACKED, PER_TENSOR, DIRECT, VERIFY, NAMES = 0, 1, 2, 3, 9, 5
TIMEOUT = datetime.timedelta(minutes=10)


def _bcast(group, t: torch.Tensor, root: int = 0) -> None:  # type: ignore[no-untyped-def]
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    group.broadcast([t], opts).wait(TIMEOUT)


def _ack(group) -> None:  # type: ignore[no-untyped-def]
    opts = dist.AllreduceOptions()
    group.allreduce([torch.zeros(1)], opts).wait(TIMEOUT)


def _digest(tensors: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    """An exact checksum of every tensor's bits (int64 weighted sums)."""
    out = torch.zeros(len(names), dtype=torch.int64)
    for i, n in enumerate(names):
        t = tensors[n].contiguous().reshape(-1)
        bits = t.view(torch.int16).to(torch.int64)
        w = torch.arange(bits.numel(), dtype=torch.int64) % 65521 + 1
        out[i] = (bits * w).sum()
    return out


def _command(group, cmd: int = 0, arg: int = 0) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    t = torch.tensor([cmd, arg], dtype=torch.int64)
    _bcast(group, t)
    return int(t[0]), int(t[1])


def worker(size_gb: float, port: int, direct_port: int, out: str) -> None:
    """The inference side: plain bf16 models (one per sync group), receiving whatever
    rank 0 announces."""
    torch.set_num_threads(1)
    from shardgather.testing import build_gpt

    model = build_gpt(size_gb)
    targets = [{k: v.to(torch.bfloat16) for k, v in model.state_dict().items()} for _ in range(2)]
    del model
    group = sg.connect_sync_group("127.0.0.1", port, 1, 2, timeout=TIMEOUT)
    direct = sg.connect_sync_group("127.0.0.1", direct_port, 2, 3, timeout=TIMEOUT)
    receivers = {
        PACKED: sg.WeightReceiver(group, target=targets[0], timeout=TIMEOUT),
        DIRECT: sg.WeightReceiver(direct, target=targets[1], timeout=TIMEOUT),
    }
    target = targets[0]
    names: list[str] = []
    rss = []
    while True:
        # The measure starts (its malloc_trim, its baseline) before the next command
        # arrives, not inside the trainers' timed sync.
        with peak_rss_rise() as m:
            cmd, arg = _command(group)
            if cmd in (PACKED, DIRECT):
                receivers[cmd].receive()
        if cmd in (PACKED, DIRECT):
            rss.append(m["peak_rise"])
        if cmd == STOP:
            break
        if cmd == NAMES:
            raw = torch.empty(arg, dtype=torch.uint8)
            _bcast(group, raw)
            names = json.loads(bytes(raw.numpy()))
        elif cmd == PER_TENSOR:
            for n in names:
                _bcast(group, target[n])
            _ack(group)
        elif cmd == VERIFY:
            _bcast(group, _digest(targets[arg], names), root=1)
    with open(out, "w") as f:
        json.dump({"peak_rss_rise": max(rss or [0])}, f)
    os._exit(0)


def trainer(
    rank: int, world: int, size_gb: float, port: int, direct_port: int, repeats: int
) -> dict:
    from bench_hf_save import _sharded
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from shardgather.testing import build_gpt

    model = _sharded(build_gpt(size_gb), 2, world)
    group = sg.connect_sync_group("127.0.0.1", port, 0, 2, timeout=TIMEOUT) if rank == 0 else None
    direct = sg.connect_sync_group("127.0.0.1", direct_port, rank, 3, timeout=TIMEOUT)
    bf16 = torch.bfloat16
    senders = {
        "relayed": sg.WeightSender(model, group, dtype=bf16, timeout=TIMEOUT),
        "direct": sg.WeightSender(model, direct, dtype=bf16, timeout=TIMEOUT),
    }
    commands = {"relayed": PACKED, "direct": DIRECT}
    gatherer = sg.Gatherer(model, dtype=bf16, timeout=TIMEOUT)
    # The order the streaming gatherer yields (tied weights once): the worker receives
    # the per-tensor methods' messages in it.
    names = [k for k, _ in gatherer.iter_full_tensors()]
    if rank == 0:
        raw = torch.frombuffer(bytearray(json.dumps(names).encode()), dtype=torch.uint8)
        _command(group, NAMES, raw.numel())
        _bcast(group, raw)

    def verify(which: int) -> bool:
        truth = sg.full_state_dict(model, dtype=bf16)
        ok = True
        if rank == 0:
            _command(group, VERIFY, which)
            theirs = torch.zeros(len(names), dtype=torch.int64)
            _bcast(group, theirs, root=1)
            ok = bool(torch.equal(theirs, _digest(truth, names)))
        del truth
        return ok

    def syncing(mode: str, full: bool):  # type: ignore[no-untyped-def]
        def go() -> dict:
            if rank == 0:
                _command(group, commands[mode])
            out = senders[mode].sync(full=full)
            if mode == "direct":  # every rank sent its own part: the wire carried the sum
                out["bytes"] = _sum(out["bytes"])
            return out

        return go

    def _sum(n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t)
        return int(t)

    def per_tensor() -> dict:
        if rank == 0:
            _command(group, PER_TENSOR)
        sent = 0
        for _, t in gatherer.iter_full_tensors():
            _bcast(group, t)
            sent += t.numel() * t.element_size()
        if rank == 0:
            _ack(group)
        return {"bytes": sent}

    def torch_way() -> dict:
        if rank == 0:
            _command(group, PER_TENSOR)
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        sd = get_model_state_dict(model, options=opts)
        sent = 0
        if rank == 0:
            for n in names:
                t = sd[n].to(bf16)
                _bcast(group, t)
                sent += t.numel() * t.element_size()
            _ack(group)
        del sd
        return {"bytes": sent}

    full_methods = {
        "full: WeightSender.sync(full=True), direct": syncing("direct", True),
        "full: WeightSender.sync(full=True), relayed packed buckets": syncing("relayed", True),
        "full: iter_full_tensors + a broadcast per tensor": per_tensor,
        "full: get_model_state_dict + a broadcast per tensor": torch_way,
    }
    stats: dict[str, dict] = {}

    def run(name: str, fn, which: int = 0) -> None:  # type: ignore[no-untyped-def]
        dist.barrier()
        with peak_rss_rise() as m:
            t0 = time.perf_counter()
            res = fn()
            dist.barrier()
            dt = time.perf_counter() - t0
        s = stats.setdefault(name, {"times": [], "rss": [], "bytes": [], "ok": [], "changed": []})
        s["times"].append(dt)
        s["rss"].append(m["peak_rise"])
        s["bytes"].append(res.get("bytes", 0))
        s["changed"].append(res.get("changed"))
        s["ok"].append(verify(which))

    order = list(full_methods)
    for rep in range(repeats + 1):
        for name in order if rep % 2 == 0 else order[::-1]:
            run(name, full_methods[name], 1 if "direct" in name else 0)
    for mode in senders:  # each receiver holds what its sender last sent: deltas start here
        syncing(mode, True)()
    own = [p.to_local().detach().reshape(-1) for p in model.parameters()]
    numel = sum(t.numel() for t in own)
    gen = torch.Generator().manual_seed(rank)

    def bump(fraction: float) -> None:
        for t in own:
            k = int(t.numel() * fraction)
            if k:
                idx = torch.randint(0, t.numel(), (k,), generator=gen)
                t.view(torch.int32).index_add_(0, idx, torch.full((k,), 1 << 16, dtype=torch.int32))

    fractions = [0.005, 0.02, 0.10]
    modes = list(senders)
    for rep in range(repeats + 1):
        for i, f in enumerate(fractions if rep % 2 == 0 else fractions[::-1]):
            bump(f)  # once: both senders then find the same elements changed
            for mode in modes if (rep + i) % 2 == 0 else modes[::-1]:
                name = f"delta {mode}: {f * 100:g} % of elements changed"
                run(name, syncing(mode, False), 1 if mode == "direct" else 0)
    if rank == 0:
        _command(group, STOP)
    for s in stats.values():  # the first round was a warm-up
        s["first_s"] = s["times"][0]
        for k in ("times", "rss", "bytes", "changed"):
            s[k] = s[k][1:]
    return {"stats": stats, "numel": numel}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    port, direct_port = _port(), _port()
    import tempfile

    tmp = tempfile.mkdtemp(prefix="sg-bench-sync-")
    w_out = os.path.join(tmp, "worker.json")
    w = mp.get_context("spawn").Process(
        target=worker, args=(args.size_gb, port, direct_port, w_out)
    )
    w.start()
    per_rank = run_ranks(trainer, 2, args.size_gb, port, direct_port, args.repeats)
    w.join(120)
    with open(w_out) as f:
        worker_rss = json.load(f)["peak_rss_rise"]
    rows = []
    r0 = per_rank[0]["stats"]
    base_full = statistics.median(r0["full: WeightSender.sync(full=True), direct"]["times"])
    print(
        f"\n{args.size_gb} GiB GPT (fp32), FSDP2 world 2 -> 1 worker, sent as bf16, median of {args.repeats}"
    )
    print(f"{'method':56} first s  time s  x direct  MiB on the wire  RSS rise MiB r0/r1  ok")
    for name, s in r0.items():
        t = statistics.median(s["times"])
        sent = statistics.median(s["bytes"]) / MiB
        rss = [max(pr["stats"][name]["rss"]) / MiB for pr in per_rank]
        ok = all(s["ok"])
        print(
            f"{name:56} {s['first_s']:7.3f} {t:7.3f} {t / base_full:8.2f} {sent:16.1f}  "
            f"{rss[0]:6.0f}/{rss[1]:<6.0f} {ok}"
        )
        rows.append(
            {
                "method": name,
                "time_s": t,
                "times_s": s["times"],
                "first_call_s": s["first_s"],
                "time_ratio_vs_direct_full": t / base_full,
                "bytes_on_the_wire": s["bytes"],
                "changed_elements": s["changed"],
                "peak_rss_rise_per_rank": [max(pr["stats"][name]["rss"]) for pr in per_rank],
                "verified_bit_exact": ok,
            }
        )
    print(f"worker's peak RSS rise while receiving: {worker_rss / MiB:.0f} MiB")
    write_json(
        args.json,
        "bench_weight_sync.py",
        args,
        trainer_elements_per_rank=[pr["numel"] for pr in per_rank],
        worker_peak_rss_rise=worker_rss,
        results=rows,
    )


if __name__ == "__main__":
    main()
