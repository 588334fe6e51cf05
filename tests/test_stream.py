"""iter_full_tensors and Gatherer in real gloo processes: every entry once, bit-exact
with torch's own full state dict, into reused buffers, in bounded memory; a consumer
that stops on one rank makes every rank raise, and the next call works."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

import shardgather as sg

from . import dist_harness
from .compare import diff_state_dicts
from .models import TinyLM, make_optimizer, train_steps

pytestmark = pytest.mark.distributed
MiB = 2**20


def _torch_full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def _want(model: torch.nn.Module, rank: int, dtype: torch.dtype | None) -> dict | None:  # type: ignore[type-arg]
    """The oracle: torch's own full state dict (rank 0), cast like the stream casts."""
    ref = _torch_full(model)
    if rank != 0:
        return None
    return {
        k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v)
        for k, v in ref.items()
    }


def stream_worker(rank: int, world: int, kind: str, dtype: str | None, bucket_mb: float) -> dict:  # type: ignore[type-arg]
    from .builders import build

    cast = getattr(torch, dtype) if dtype else None
    model, _ = build(kind, world, seed=0)
    opt = make_optimizer(model)
    train_steps(model, rank, 1, opt)
    want = _want(model, rank, cast)
    problems: list[str] = []
    primaries = [k for k in TinyLM().state_dict() if k != "lm_head.weight"]  # tied alias

    gatherer = sg.Gatherer(model, dtype=cast, bucket_mb=bucket_mb, rank0_only=False)
    for owned in (False, True):
        got: dict[str, torch.Tensor] = {}
        for key, t in gatherer.iter_full_tensors(owned=owned):
            if key in got:
                problems.append(f"{key} yielded twice")
            got[key] = t.clone() if not owned else t  # views live until the next next()
        if sorted(got) != sorted(primaries):
            problems.append(f"owned={owned}: keys {sorted(set(got) ^ set(primaries))}")
        everyone = sg.full_state_dict(model, rank0_only=False, dtype=cast, transport="collective")
        ref = want if rank == 0 else everyone
        assert ref is not None
        problems += [
            f"owned={owned}: " + p
            for p in diff_state_dicts(got, {k: ref[k] for k in got}, order=False)
        ]
    # Rank 0 only: the others take part and yield nothing.
    only0 = sg.Gatherer(model, dtype=cast, bucket_mb=bucket_mb)
    n = sum(1 for _ in only0.iter_full_tensors())
    if (rank == 0) != (n == len(primaries)) or (rank != 0 and n):
        problems.append(f"rank0_only: rank {rank} got {n} tensors")

    # The dict verb, repeated: the same dict, written in place, right after each step.
    sds = []
    for step in range(3):
        sds.append(only0.full_state_dict())
        want = _want(model, rank, cast)
        if rank == 0:
            problems += [f"call {step}: " + p for p in diff_state_dicts(sds[-1], want)]
        train_steps(model, rank, 1, opt, start=1 + step)
    if rank == 0 and not (sds[0] is sds[1] is sds[2]):
        problems.append("Gatherer.full_state_dict returned a new dict")
    only0.close()
    gatherer.close()
    return {"problems": problems}


STREAM_CASES = {
    # id: (world, kind, dtype, bucket_mb)
    "fsdp2": (2, "fsdp2", None, 16),
    "fsdp2-tiny_buckets": (2, "fsdp2", None, 0.0005),  # parameters spread over buckets
    "fsdp1-tiny_buckets-bf16": (2, "fsdp1", "bfloat16", 0.0005),
    "fsdp1_orig-world3": (3, "fsdp1-orig", None, 0.001),
    "hsdp": (4, "fsdp2-hsdp", None, 0.001),
}


@pytest.mark.parametrize("case", list(STREAM_CASES))
def test_stream_and_reused_dict(case: str) -> None:
    world, kind, dtype, bucket_mb = STREAM_CASES[case]
    results = dist_harness.run(
        "tests.test_stream:stream_worker", world, kind=kind, dtype=dtype, bucket_mb=bucket_mb
    )
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)


def consumer_fails_worker(rank: int, world: int) -> dict:  # type: ignore[type-arg]
    from .builders import build

    model, _ = build("fsdp2", world, seed=0)
    out: dict = {}
    timeout = datetime.timedelta(seconds=30)
    try:
        for i, _ in enumerate(sg.iter_full_tensors(model, bucket_mb=0.001, timeout=timeout)):
            if rank == 0 and i == 3:
                raise ValueError("the inference engine refused a tensor")
        out["raised"] = None
    except Exception as exc:
        out["raised"] = (type(exc).__name__, str(exc))
    # Rank 0 breaks out of its loop: no error of its own, the others are told so.
    try:
        for i, _ in enumerate(sg.iter_full_tensors(model, bucket_mb=0.001, timeout=timeout)):
            if rank == 0 and i == 3:
                break
        out["after_break"] = None
    except Exception as exc:
        out["after_break"] = (type(exc).__name__, str(exc))
    # The process group is healthy: the next calls work.
    sd = sg.full_state_dict(model)
    ref = _torch_full(model)  # collective: every rank, before anything rank-dependent
    out["next_ok"] = rank != 0 or not diff_state_dicts(sd, ref)
    out["next_stream"] = sum(1 for _ in sg.iter_full_tensors(model, rank0_only=False))
    dist.barrier()
    return out


def test_a_consumer_that_fails_on_one_rank_raises_everywhere() -> None:
    r0, r1 = dist_harness.run("tests.test_stream:consumer_fails_worker", 2, timeout=120)
    assert r0["raised"] == ("ValueError", "the inference engine refused a tensor"), r0
    assert r1["raised"][0] == "CollectiveError" and "rank 0: its loop stopped" in r1["raised"][1]
    # Regression: a break told rank 1 to "see its error", which did not exist.
    assert r0["after_break"] is None, r0
    cls, msg = r1["after_break"]
    assert cls == "CollectiveError" and "a `break`" in msg and "see its error" not in msg, msg
    assert "every rank must iterate to the end" in msg, msg
    assert r0["next_ok"] and r1["next_ok"]
    assert r0["next_stream"] == r1["next_stream"] == len(TinyLM().state_dict()) - 1


def memory_worker(rank: int, world: int, size_gb: float, bucket_mb: float) -> dict:  # type: ignore[type-arg]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardgather._memory import peak_rss_rise, trim
    from shardgather.testing import build_gpt

    model = build_gpt(size_gb)
    mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    g = sg.Gatherer(model, bucket_mb=bucket_mb, rank0_only=False)
    out: dict = {"largest": largest, "stream": [], "dict": []}
    for _ in range(2):  # first call and steady state
        trim()
        seen = 0
        with peak_rss_rise() as m:
            for _, t in g.iter_full_tensors():
                seen += t.numel() * t.element_size()
        out["stream"].append(m["peak_rise"])
    out["seen"] = seen
    g.close()
    g = sg.Gatherer(model, bucket_mb=bucket_mb)
    for _ in range(5):
        trim()
        with peak_rss_rise() as m:
            g.full_state_dict()
        out["dict"].append(m["peak_rise"] + m.get("shm_rise", 0))
    g.close()
    return out


def test_stream_memory_is_bounded_and_repeated_dicts_allocate_nothing() -> None:
    bucket_mb = 16
    results = dist_harness.run(
        "tests.test_stream:memory_worker", 2, timeout=400, size_gb=0.3, bucket_mb=bucket_mb
    )
    # The gathered rows + one slab of outputs, and the embedding (larger than a bucket,
    # so assembled in a buffer of its own while its buckets go by).
    staging = 2 * bucket_mb * MiB
    for r in results:
        assert r["seen"] > 10 * bucket_mb * MiB, r  # many buckets went by
        for rise in r["stream"]:
            assert rise <= staging + r["largest"] + 64 * MiB, r
        assert r["stream"][1] <= staging + 64 * MiB, r  # steady state: all reused
    # After the first call the dict is written in place: no new memory at all.
    r0 = results[0]
    assert r0["dict"][0] > 200 * MiB, r0  # the first call makes the output
    for rise in r0["dict"][1:] + results[1]["dict"][1:]:
        assert rise <= 16 * MiB, results
