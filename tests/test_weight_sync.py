"""Weight sync for RL: 2 trainer ranks (FSDP2 or FSDP1, their own gloo world) and 1
"inference" process holding a plain copy of the model, joined by a separate sync group;
after every training step the inference copy equals the trainer's full state bit-exactly,
for full and delta syncs; a receiver that refuses, raises or dies makes every trainer
rank raise within the timeout."""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

import shardgather as sg

from .compare import diff_state_dicts
from .models import TinyLM

TIMEOUT = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(d: int = 12) -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyLM(d=d, hidden=40)


def _trainer(rank: int, tmp: str, port: int, kw: dict) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    out: Any
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/rdv",
            rank=rank,
            world_size=2,
            timeout=datetime.timedelta(seconds=60),
        )
        out = _train(rank, port, **kw)
    except BaseException as exc:
        out = {"__error__": traceback.format_exc(), "type": type(exc).__name__}
    torch.save(out, f"{tmp}/trainer{rank}.pt")
    os._exit(0)


def _train(rank: int, port: int, fsdp: str, steps: int, dtype: Any, delta: bool, **_: Any) -> dict:
    import torch.distributed as dist

    model = _model()
    if fsdp == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    timeout = datetime.timedelta(seconds=TIMEOUT)
    group = sg.connect_sync_group("127.0.0.1", port, 0, 2, timeout=timeout) if rank == 0 else None
    sender = sg.WeightSender(model, group, dtype=dtype, delta=delta, timeout=timeout)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(rank)
    truth, stats = [], []
    for _ in range(steps):
        try:
            stats.append(sender.sync())
        except Exception as exc:
            return {"raised": f"{type(exc).__name__}: {exc}", "at": time.monotonic()}
        truth.append(sg.full_state_dict(model, dtype=dtype))
        loss = model(torch.randint(0, 37, (2, 5), generator=gen)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    return {"truth": truth, "stats": stats}


def _consumer(tmp: str, port: int, kw: dict) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    out: Any
    try:
        out = _consume(port, **kw)
    except BaseException as exc:
        out = {"raised": f"{type(exc).__name__}: {exc}", "at": time.monotonic()}
    torch.save(out, f"{tmp}/consumer.pt")
    os._exit(0)


def _consume(port: int, steps: int, dtype: Any, fail: str = "", **_: Any) -> dict:
    plain = _model()
    if dtype is not None:
        plain = plain.to(dtype)
    target = plain.state_dict()
    if fail == "missing":
        target.pop("blocks.0.fc1.weight")
    batches: list[int] = []

    def on_weights(batch: list) -> None:  # type: ignore[type-arg]
        batches.append(len(batch))
        if fail == "raise" and len(batches) == 2:
            raise ValueError("the engine refused a weight")
        if fail == "die" and len(batches) == 2:
            os._exit(3)

    timeout = datetime.timedelta(seconds=TIMEOUT)
    group = sg.connect_sync_group("127.0.0.1", port, 1, 2, timeout=timeout)
    receiver = sg.WeightReceiver(group, target=target, on_weights=on_weights, timeout=timeout)
    seen, stats = [], []
    for _ in range(steps):
        stats.append(receiver.receive())
        seen.append({k: v.clone() for k, v in plain.state_dict().items()})
    return {"seen": seen, "stats": stats, "batches": batches}


def _run(**kw: Any) -> tuple[list[dict], dict | None]:
    ctx = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="sg-sync-") as tmp:
        procs = [ctx.Process(target=_trainer, args=(r, tmp, port, kw)) for r in range(2)]
        procs.append(ctx.Process(target=_consumer, args=(tmp, port, kw)))
        for p in procs:
            p.start()
        deadline = time.monotonic() + 240
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
        trainers = []
        for r in range(2):
            path = Path(tmp) / f"trainer{r}.pt"
            assert path.exists(), f"trainer {r} left no result (exit {procs[r].exitcode})"
            res = torch.load(path, weights_only=False)
            assert "__error__" not in res, res["__error__"]
            trainers.append(res)
        path = Path(tmp) / "consumer.pt"
        consumer = torch.load(path, weights_only=False) if path.exists() else None
    return trainers, consumer


@pytest.mark.parametrize(
    ("fsdp", "dtype"), [("fsdp2", torch.bfloat16), ("fsdp2", None), ("fsdp1", torch.bfloat16)]
)
def test_every_sync_leaves_the_engine_bit_exact(fsdp, dtype) -> None:  # type: ignore[no-untyped-def]
    trainers, consumer = _run(fsdp=fsdp, steps=4, dtype=dtype, delta=True)
    assert consumer is not None and "raised" not in consumer, consumer
    truth = trainers[0]["truth"]
    for step, (want, got) in enumerate(zip(truth, consumer["seen"])):
        assert not diff_state_dicts(got, want, order=False), (
            step,
            diff_state_dicts(got, want, order=False),
        )
    modes = [s["mode"] for s in trainers[0]["stats"]]
    assert modes == ["full", "delta", "delta", "delta"], modes
    assert [s["mode"] for s in consumer["stats"]] == modes
    full, deltas = trainers[0]["stats"][0], trainers[0]["stats"][1:]
    # What changed crossed the wire, not everything (AdamW moves most fp32 values; in
    # bf16 only those that cross a rounding step change).
    assert all(s["changed"] > 0 for s in deltas)
    assert all(s["bytes"] < full["bytes"] for s in deltas) or dtype is None


def test_full_syncs_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    trainers, consumer = _run(fsdp="fsdp2", steps=2, dtype=torch.bfloat16, delta=False)
    assert consumer is not None and "raised" not in consumer, consumer
    assert [s["mode"] for s in trainers[0]["stats"]] == ["full", "full"]
    assert not diff_state_dicts(consumer["seen"][1], trainers[0]["truth"][1], order=False)


def test_a_layout_mismatch_fails_both_sides() -> None:
    trainers, consumer = _run(
        fsdp="fsdp2", steps=1, dtype=torch.bfloat16, delta=True, fail="missing"
    )
    assert consumer is not None and "blocks.0.fc1.weight" in consumer["raised"], consumer
    for t in trainers:
        assert "refused the layout" in t["raised"], t


def test_a_receiver_that_raises_fails_every_trainer_rank() -> None:
    trainers, consumer = _run(fsdp="fsdp2", steps=2, dtype=torch.bfloat16, delta=True, fail="raise")
    assert consumer is not None and "the engine refused a weight" in consumer["raised"], consumer
    for t in trainers:
        assert "failed while applying" in t["raised"], t


def test_a_receiver_that_dies_fails_every_trainer_rank_within_the_timeout() -> None:
    t0 = time.monotonic()
    trainers, consumer = _run(fsdp="fsdp2", steps=2, dtype=torch.bfloat16, delta=True, fail="die")
    assert consumer is None
    for t in trainers:
        assert "raised" in t, t
        assert t["at"] - t0 < TIMEOUT + 30, t["at"] - t0
