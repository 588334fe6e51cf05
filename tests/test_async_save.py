"""Saving while training runs (``blocking=False``): the call returns once every rank has
copied its own bytes aside, the optimizer steps at once, and the file still holds the
values at call time, bit-exact; failures in the background surface at ``wait()`` on
every rank and lose nothing; memory is the rank's own bytes. Real gloo processes."""

from __future__ import annotations

import datetime
import errno
import os

import pytest
import torch
import torch.distributed as dist

import shardgather as sg

from . import dist_harness
from .builders import build, same_osd
from .compare import diff_state_dicts
from .models import TinyLM, make_optimizer, train_steps

pytestmark = pytest.mark.distributed


def _own_bytes(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """What this rank holds of the model (its shards, and on rank 0 the whole entries)."""
    from shardgather._engine.pieces import pieces_of
    from shardgather._plan import build_plan

    plan = build_plan(model, dtype=dtype)
    own = sum(pc.numel * pc.entry.target_dtype.itemsize for pc in pieces_of(plan, lambda i: True))
    if dist.get_rank() == 0:
        own += sum(e.nbytes for e in plan.entries.values() if e.source.group is None)
    return own


def step_right_after_worker(rank: int, world: int, root: str, kind: str, dtype: str | None) -> dict:  # type: ignore[type-arg]
    cast = getattr(torch, dtype) if dtype else None
    model, _ = build(kind, world, seed=0)
    opt = make_optimizer(model, "adamw")
    train_steps(model, rank, 1, opt)
    problems: list[str] = []
    for i in range(2):  # the second save reuses the first one's snapshot buffer
        want = sg.full_state_dict(model, dtype=cast)
        path = os.path.join(root, f"m{i}.safetensors")
        handle = sg.save_full_state_dict(model, path, dtype=cast, blocking=False)
        train_steps(model, rank, 2, opt, start=1 + 2 * i)  # mutates params in place, now
        if handle.snapshot_bytes != _own_bytes(model, cast):
            problems.append(f"snapshot {handle.snapshot_bytes} != own {_own_bytes(model, cast)}")
        handle.wait()
        handle.wait()  # idempotent
        ckpt = os.path.join(root, f"ckpt{i}")
        ck = sg.save_checkpoint(ckpt, model, opt, extra={"i": i}, blocking=False)
        after = sg.full_state_dict(model)  # the values at the checkpoint's call time
        after_osd = sg.full_optim_state_dict(model, opt)
        train_steps(model, rank, 1, opt, start=10 + i)
        ck.wait()
        fresh, _ = build(kind, world, seed=7)
        fopt = make_optimizer(fresh, "adamw")
        extra = sg.load_checkpoint(ckpt, fresh, fopt)
        got = sg.full_state_dict(fresh)
        got_osd = sg.full_optim_state_dict(fresh, fopt)
        if rank == 0:
            problems += [
                f"file {i}: " + p for p in diff_state_dicts(sg.load_file(path), want, order=False)
            ]
            problems += [f"checkpoint {i}: " + p for p in diff_state_dicts(got, after)]
            problems += [
                f"checkpoint optim {i}: " + p for p in same_osd(got_osd, after_osd, exact=True)
            ]
            if extra != {"i": i}:
                problems.append(f"extra {extra}")
    return {"problems": problems, "files": sorted(os.listdir(root)) if rank == 0 else None}


@pytest.mark.parametrize(
    ("kind", "dtype"),
    [("fsdp2", None), ("fsdp1", None), ("fsdp2", "bfloat16"), ("fsdp1-orig", None)],
    ids=["fsdp2", "fsdp1", "fsdp2-bf16", "fsdp1_orig"],
)
def test_a_step_right_after_the_call_does_not_reach_the_file(tmp_path, kind, dtype) -> None:  # type: ignore[no-untyped-def]
    results = dist_harness.run(
        "tests.test_async_save:step_right_after_worker",
        2,
        root=str(tmp_path),
        kind=kind,
        dtype=dtype,
    )
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert results[0]["files"] == ["ckpt0", "ckpt1", "m0.safetensors", "m1.safetensors"]


def background_failure_worker(rank: int, world: int, root: str) -> dict:  # type: ignore[type-arg]
    """Rank 1's disk fills up in the background: wait() raises on every rank, the
    previous file is intact, nothing else is left, and the next save works."""
    from shardgather._engine import snapshot

    model, _ = build("fsdp2", world, seed=0)
    opt = make_optimizer(model, "adamw")
    path = os.path.join(root, "m.safetensors")
    sg.save_full_state_dict(model, path)  # the previous checkpoint
    before = sg.full_state_dict(model)
    train_steps(model, rank, 1, opt)
    real = snapshot.pwrite_from
    if rank == 1:

        def full(*a, **k):  # type: ignore[no-untyped-def]
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")

        snapshot.pwrite_from = full
    handle = sg.save_full_state_dict(
        model, path, blocking=False, timeout=datetime.timedelta(seconds=60)
    )
    train_steps(model, rank, 1, opt, start=1)
    out: dict = {}
    try:
        handle.wait()
        out["raised"] = None
    except sg.ShardGatherError as exc:
        out["raised"] = (type(exc).__name__, str(exc))
    snapshot.pwrite_from = real
    dist.barrier()
    out["left"] = sorted(os.listdir(root))
    problems = []
    if rank == 0:
        problems += [
            "previous: " + p for p in diff_state_dicts(sg.load_file(path), before, order=False)
        ]
    # The same processes save again, in the background, and it lands.
    now = sg.full_state_dict(model)
    sg.save_full_state_dict(model, path, blocking=False).wait()
    if rank == 0:
        problems += ["next: " + p for p in diff_state_dicts(sg.load_file(path), now, order=False)]
    out["problems"] = problems
    return out


def test_a_background_failure_surfaces_at_wait_on_every_rank(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = dist_harness.run(
        "tests.test_async_save:background_failure_worker", 2, root=str(tmp_path)
    )
    for r in results:
        assert r["raised"] is not None and r["raised"][0] == "CollectiveError", r
        assert "rank 1" in r["raised"][1] and "No space left" in r["raised"][1], r
        assert r["left"] == ["m.safetensors"], r  # no temporary, the old file in place
        assert not r["problems"], r["problems"]


def in_flight_worker(rank: int, world: int, root: str) -> dict:  # type: ignore[type-arg]
    model, _ = build("fsdp2", world, seed=0)
    a = sg.save_full_state_dict(model, os.path.join(root, "a.safetensors"), blocking=False)
    out: dict = {}
    try:
        sg.save_full_state_dict(model, os.path.join(root, "b.safetensors"), in_flight="error")
        out["error"] = None
    except sg.ShardGatherError as exc:
        out["error"] = str(exc)
    # The default waits for the save in flight (it is then published), then saves.
    sg.save_full_state_dict(model, os.path.join(root, "b.safetensors"))
    out["a_done"] = a.done()
    a.wait()  # already finished: returns at once
    dist.barrier()
    out["files"] = sorted(os.listdir(root))
    return out


def test_one_save_in_flight_per_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for r in dist_harness.run("tests.test_async_save:in_flight_worker", 2, root=str(tmp_path)):
        assert r["error"] is not None and "still in flight" in r["error"], r
        assert r["a_done"] and r["files"] == ["a.safetensors", "b.safetensors"], r


def memory_worker(rank: int, world: int, root: str, size_gb: float) -> dict:  # type: ignore[type-arg]
    """The snapshot is the rank's own bytes; a second save allocates nothing new."""
    from torch.distributed.fsdp import fully_shard

    from shardgather._memory import peak_rss_rise, trim
    from shardgather.testing import build_gpt

    model = build_gpt(size_gb)
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    own = _own_bytes(model)
    rises = []
    for i in range(2):
        trim()
        with peak_rss_rise() as m:
            h = sg.save_full_state_dict(
                model, os.path.join(root, f"m{i}.safetensors"), blocking=False
            )
            h.wait()
        rises.append(m["peak_rise"])
    return {"own": own, "rises": rises}


def test_the_snapshot_costs_the_ranks_own_bytes_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = dist_harness.run(
        "tests.test_async_save:memory_worker", 2, timeout=300, root=str(tmp_path), size_gb=0.2
    )
    slack = 32 * 2**20
    for r in results:
        first, second = r["rises"]
        assert first <= r["own"] + slack, r
        assert second <= slack, r  # the kept buffer is reused


def test_plain_model_in_one_process(tmp_path) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    handle = sg.save_full_state_dict(model, tmp_path / "m.safetensors", blocking=False)
    train_steps(model, 0, 1, opt)
    handle.wait()
    assert not diff_state_dicts(sg.load_file(tmp_path / "m.safetensors"), want, order=False)
    # Paced (the background writer sleeps between writes) and capped (what does not fit
    # the snapshot is written at call time): the same bytes.
    want = {k: v.clone() for k, v in model.state_dict().items()}
    handle = sg.save_full_state_dict(
        model, tmp_path / "p.safetensors", blocking=False, write_mb_per_s=50, max_snapshot_mb=0.001
    )
    train_steps(model, 0, 1, opt)
    handle.wait()
    assert not diff_state_dicts(sg.load_file(tmp_path / "p.safetensors"), want, order=False)
    with pytest.raises(sg.ShardGatherError, match="write_mb_per_s"):
        sg.save_full_state_dict(model, tmp_path / "x.safetensors", blocking=False, write_mb_per_s=0)


def test_a_wait_that_times_out_leaves_the_writer_its_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """wait(timeout) shorter than the (paced) background writes: it raises, publishes
    nothing, and closes the writer's files only once the writer ends — closed at once,
    their descriptor numbers went to the next open and the writer wrote the checkpoint
    into that unrelated file (8 MiB, measured before the fix). Then the temporaries go
    and the next save works."""
    import time

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    handle = sg.save_full_state_dict(
        model, tmp_path / "a.safetensors", blocking=False, write_mb_per_s=4
    )
    with pytest.raises(sg.CollectiveError, match="did not finish within"):
        handle.wait(timeout=datetime.timedelta(seconds=0.3))
    victim = os.open(tmp_path / "victim", os.O_RDWR | os.O_CREAT, 0o644)  # the lowest free fd
    try:
        deadline = time.monotonic() + 60
        while not handle.done() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert handle.done()
        assert os.fstat(victim).st_size == 0
    finally:
        os.close(victim)
    assert sorted(os.listdir(tmp_path)) == ["victim"]  # nothing published, no temporary
    with pytest.raises(sg.CollectiveError):
        handle.wait()  # the same outcome again
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    sg.save_full_state_dict(model, tmp_path / "a.safetensors", blocking=False).wait()
    assert not diff_state_dicts(sg.load_file(tmp_path / "a.safetensors"), want, order=False)


# --------------------------------------------- handles that cannot be forgotten (issue 27)

_FORGET = """
import sys, torch, shardgather as sg
from tests.models import TinyLM, make_optimizer
model = TinyLM(tied=False, d=64)
opt = make_optimizer(model)
h = sg.save_checkpoint(sys.argv[1], model, opt, blocking=False)
print(repr(h))
"""


def test_a_save_never_waited_for_warns_at_exit_and_leaves_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    out = tmp_path / "out"
    out.mkdir()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(
        [sys.executable, "-c", _FORGET, str(out / "ckpt")],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert f"-> {out / 'ckpt'}:" in r.stdout and "MiB snapshot" in r.stdout, r.stdout
    assert "was never waited for (the interpreter is exiting)" in r.stderr, r.stderr
    assert "nothing was published" in r.stderr
    assert os.listdir(out) == []  # no hidden temporary directory left behind


def test_a_handle_shows_its_path_and_state_and_waits_as_a_context_manager(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = TinyLM(tied=False)
    path = tmp_path / "m.safetensors"
    with sg.save_full_state_dict(model, path, blocking=False) as handle:
        text = repr(handle)
        assert str(path) in text and ("writing" in text or "not yet waited for" in text), text
    assert "published" in repr(handle), repr(handle)
    assert not diff_state_dicts(sg.load_file(path), model.state_dict(), order=False)


def test_a_forgotten_handle_warns_when_collected_and_removes_its_temporaries(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import gc

    model = TinyLM(tied=False)
    handle = sg.save_checkpoint(tmp_path / "ckpt", model, make_optimizer(model), blocking=False)
    handle._thread.join()
    with pytest.warns(RuntimeWarning, match="never waited for .it was garbage-collected"):
        del handle, model
        gc.collect()
    assert os.listdir(tmp_path) == []
