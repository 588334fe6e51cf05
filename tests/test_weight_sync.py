"""Weight sync for RL: 2 trainer ranks (FSDP2 or FSDP1, their own gloo world) and 1
"inference" process holding a plain copy of the model, joined by a separate sync group —
with every trainer rank (direct: each sends its own pieces) or with rank 0 alone
(relayed); after every training step the inference copy equals the trainer's full state
bit-exactly, for full and delta syncs; a receiver that refuses, raises or dies makes
every trainer rank raise within the timeout."""

from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Any

import pytest
import torch

import shardgather as sg

from . import dist_harness
from .compare import diff_state_dicts
from .models import TinyLM

TIMEOUT = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(big: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    if big:  # 84 M parameters: 336 MB in fp32, 168 MB sent as bf16
        return TinyLM(d=1024, hidden=4096, n_layers=10)
    return TinyLM(d=12, hidden=40)


def _trainer(rank: int, world: int, **kw: Any) -> dict:
    return (_train_memory if kw.get("big") else _train)(rank, **kw)


def _group(rank: int, port: int, direct: bool, worker: bool = False) -> Any:
    """The sync group: direct — trainer ranks 0 and 1, the worker 2; relayed — trainer
    rank 0 and the worker 1 (``None`` on trainer rank 1)."""
    timeout = datetime.timedelta(seconds=TIMEOUT)
    size = 3 if direct else 2
    if worker:
        return sg.connect_sync_group("127.0.0.1", port, size - 1, size, timeout=timeout)
    if rank and not direct:
        return None
    return sg.connect_sync_group("127.0.0.1", port, rank, size, timeout=timeout)


def _train(
    rank: int, port: int, fsdp: str, steps: int, dtype: Any, delta: bool, direct: bool, **_: Any
) -> dict:
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
    sender = sg.WeightSender(
        model, _group(rank, port, direct), dtype=dtype, delta=delta, timeout=timeout
    )
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


def _consumer(**kw: Any) -> dict:
    """The inference worker; what it raised is a result the tests check."""
    try:
        return _consume(**kw)
    except BaseException as exc:
        return {"raised": f"{type(exc).__name__}: {exc}", "at": time.monotonic()}


def _consume(
    port: int,
    steps: int,
    dtype: Any,
    direct: bool,
    fail: str = "",
    big: bool = False,
    has_target: bool = True,
    **_: Any,
) -> dict:
    plain = _model(big)
    if dtype is not None:
        plain = plain.to(dtype)
    target = plain.state_dict()
    if fail == "missing":
        target.pop("blocks.0.fc1.weight")
    batches: list[int] = []
    handed: dict[str, torch.Tensor] = {}  # what on_weights saw, last value per name

    def on_weights(batch: list) -> None:  # type: ignore[type-arg]
        batches.append(len(batch))
        handed.update((n, t.clone()) for n, t in batch)
        if fail == "raise" and len(batches) == 2:
            raise ValueError("the engine refused a weight")
        if fail == "die" and len(batches) == 2:
            os._exit(3)

    timeout = datetime.timedelta(seconds=TIMEOUT)
    receiver = sg.WeightReceiver(
        _group(0, port, direct, worker=True),
        target=target if has_target else None,
        on_weights=on_weights,
        timeout=timeout,
    )
    seen, handed_seen, stats = [], [], []
    for _ in range(steps):
        stats.append(receiver.receive())
        if not big:
            seen.append({k: v.clone() for k, v in plain.state_dict().items()})
            handed_seen.append(dict(handed))
    return {"seen": seen, "handed": handed_seen, "stats": stats, "batches": batches}


def _run(**kw: Any) -> tuple[list[dict], dict | None]:
    """2 trainer ranks (their own gloo world) and an inference worker outside it (None
    when it died)."""
    results = dist_harness.run(
        "tests.test_weight_sync:_trainer",
        2,
        timeout=240,
        _allow_missing=(2,),
        alongside="tests.test_weight_sync:_consumer",
        port=_free_port(),
        **kw,
    )
    return results[:2], results[2]


def _once(state: dict) -> dict:  # type: ignore[type-arg]
    """A state dict as the sync sends it: the tied head once, under the embedding's name
    (an engine's loader ties it again)."""
    return {k: v for k, v in state.items() if k != "lm_head.weight"}


MODES = pytest.mark.parametrize("direct", [True, False], ids=["direct", "relayed"])


@MODES
@pytest.mark.parametrize(
    ("fsdp", "dtype"), [("fsdp2", torch.bfloat16), ("fsdp2", None), ("fsdp1", torch.bfloat16)]
)
def test_every_sync_leaves_the_engine_bit_exact(fsdp, dtype, direct) -> None:  # type: ignore[no-untyped-def]
    trainers, consumer = _run(fsdp=fsdp, steps=4, dtype=dtype, delta=True, direct=direct)
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


@MODES
def test_full_syncs_only(direct) -> None:  # type: ignore[no-untyped-def]
    trainers, consumer = _run(
        fsdp="fsdp2", steps=2, dtype=torch.bfloat16, delta=False, direct=direct
    )
    assert consumer is not None and "raised" not in consumer, consumer
    assert [s["mode"] for s in trainers[0]["stats"]] == ["full", "full"]
    assert not diff_state_dicts(consumer["seen"][1], trainers[0]["truth"][1], order=False)
    # on_weights saw every tensor (direct: views of the target once its pieces landed)
    assert not diff_state_dicts(consumer["handed"][1], _once(trainers[0]["truth"][1]), order=False)
    if direct:  # each rank sent its own half; relayed, rank 0 sent everything
        sent = [t["stats"][1]["bytes"] for t in trainers]
        assert min(sent) > 0.4 * sum(sent), sent


@MODES
def test_a_receiver_without_a_target_gets_every_tensor_through_on_weights(direct) -> None:  # type: ignore[no-untyped-def]
    """No target to write pieces or deltas into: packed buckets from rank 0, every sync."""
    trainers, consumer = _run(
        fsdp="fsdp2", steps=3, dtype=torch.bfloat16, delta=True, direct=direct, has_target=False
    )
    assert consumer is not None and "raised" not in consumer, consumer
    assert [s["mode"] for s in trainers[0]["stats"]] == ["full"] * 3
    for want, got in zip(trainers[0]["truth"], consumer["handed"]):
        assert not diff_state_dicts(got, _once(want), order=False)


@MODES
def test_a_layout_mismatch_fails_both_sides(direct) -> None:  # type: ignore[no-untyped-def]
    trainers, consumer = _run(
        fsdp="fsdp2", steps=1, dtype=torch.bfloat16, delta=True, fail="missing", direct=direct
    )
    assert consumer is not None and "blocks.0.fc1.weight" in consumer["raised"], consumer
    for t in trainers:  # the class too, on the ranks that learnt it from a peer
        assert t["raised"].startswith("ConsumerError: ") and "refused the layout" in t["raised"], t


@MODES
def test_a_receiver_that_raises_fails_every_trainer_rank(direct) -> None:  # type: ignore[no-untyped-def]
    trainers, consumer = _run(
        fsdp="fsdp2", steps=2, dtype=torch.bfloat16, delta=True, fail="raise", direct=direct
    )
    assert consumer is not None and "the engine refused a weight" in consumer["raised"], consumer
    for t in trainers:
        assert t["raised"].startswith("ConsumerError: "), t
        assert "failed while applying" in t["raised"], t


@MODES
def test_a_receiver_that_dies_fails_every_trainer_rank_within_the_timeout(direct) -> None:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    trainers, consumer = _run(
        fsdp="fsdp2", steps=2, dtype=torch.bfloat16, delta=True, fail="die", direct=direct
    )
    assert consumer is None
    for t in trainers:
        assert "raised" in t, t
        assert t["at"] - t0 < TIMEOUT + 30, t["at"] - t0


def _train_memory(rank: int, port: int, steps: int, dtype: Any, direct: bool, **_: Any) -> dict:
    """Each sync's peak RSS rise on this trainer rank: the first (full) one, then deltas
    after the bench-style bump of 2 % and 10 % of this rank's elements."""
    from torch.distributed.fsdp import fully_shard

    from shardgather._memory import peak_rss_rise

    model = _model(big=True)
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    timeout = datetime.timedelta(seconds=TIMEOUT)
    sender = sg.WeightSender(model, _group(rank, port, direct), dtype=dtype, timeout=timeout)
    own = [p.to_local().detach().reshape(-1) for p in model.parameters()]
    gen = torch.Generator().manual_seed(rank)
    rises, stats = [], []
    for fraction in (0.0, 0.02, 0.10)[:steps]:
        for t in own:
            k = int(t.numel() * fraction)
            if k:
                idx = torch.randint(0, t.numel(), (k,), generator=gen)
                t.view(torch.int32).index_add_(0, idx, torch.full((k,), 1 << 16, dtype=torch.int32))
        with peak_rss_rise() as m:
            stats.append(sender.sync())
        rises.append(m["peak_rise"])
    shard = sum(t.numel() for t in own) * 2  # the kept reference: this rank's bf16 shard
    return {"rises": rises, "stats": stats, "reference": shard}


@MODES
def test_memory_per_trainer_rank_is_two_buckets_and_the_reference(direct) -> None:  # type: ignore[no-untyped-def]
    """A 336 MB model (168 MB as bf16), world 2: no sync holds the model on any rank —
    the first (full) one keeps the delta reference (its own bf16 shard) and at most two
    buckets; a delta sync, two buckets (16 MiB each) — plus 64 MiB."""
    trainers, consumer = _run(big=True, steps=3, dtype=torch.bfloat16, direct=direct)
    assert consumer is not None and "raised" not in consumer, consumer
    mib = 2**20
    for rank, t in enumerate(trainers):
        assert [s["mode"] for s in t["stats"]] == ["full", "delta", "delta"]
        full, *deltas = t["rises"]
        assert full <= t["reference"] + 2 * 16 * mib + 64 * mib, (rank, full / mib)
        for rise in deltas:
            assert rise <= 2 * 16 * mib + 64 * mib, (rank, [r / mib for r in t["rises"]])


def test_a_member_that_never_joins_is_named_within_the_arrival_bound() -> None:
    """Trainer rank 0 waits for two workers that never start: it raises within the
    arrival bound (not the 10-minute timeout, not torch's "2/3 clients joined"), naming
    the missing ranks and the address; a worker with no trainer there says so too."""
    port = _free_port()
    previous = sg.set_arrival_timeout(2)
    try:
        t0 = time.monotonic()
        with pytest.raises(sg.CollectiveError) as info:
            sg.connect_sync_group("127.0.0.1", port, rank=0, world_size=3)
        assert time.monotonic() - t0 < 30
        msg = str(info.value)
        assert "ranks 1, 2 of the sync group" in msg and f"127.0.0.1:{port}" in msg, msg
        t0 = time.monotonic()
        nobody = _free_port()
        with pytest.raises(sg.CollectiveError, match=f"127.0.0.1:{nobody}") as info:
            sg.connect_sync_group("127.0.0.1", nobody, rank=1, world_size=2)
        assert time.monotonic() - t0 < 30
        assert "trainer rank 0 listens there" in str(info.value), info.value
    finally:
        sg.set_arrival_timeout(previous)
