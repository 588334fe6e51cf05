"""One way to fail: a rank that raises, dies or is stuck at any point of a call makes
every rank raise — the same error, naming the failed rank — within the call's timeout
(+ 15 s), never a hang; the same processes then make the next call. And the calls are
cheap to agree: the collectives (rounds) a repeated call issues are counted.

Real gloo processes; each scenario's worker is next to its test.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Callable, Iterator

import pytest
import torch.distributed as dist

import shardgather as sg

from . import dist_harness
from .builders import build
from .compare import diff_state_dicts

pytestmark = pytest.mark.distributed

SLACK_S = 15  # the "small constant" of "within the call's timeout"


def _timed(fn) -> tuple[str | None, str, float]:  # type: ignore[no-untyped-def]
    t = time.monotonic()
    try:
        fn()
        return None, "", time.monotonic() - t
    except sg.ShardGatherError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t


def _next_call_works(model, plain_sd, path: str) -> list[str]:  # type: ignore[no-untyped-def]
    """The same processes, the next calls: a gather, a collective save, a load."""
    problems: list[str] = []
    got = sg.full_state_dict(model, transport="collective")
    if dist.get_rank() == 0:
        problems += ["gather: " + p for p in diff_state_dicts(got, plain_sd)]
    sg.save_full_state_dict(model, path, transport="collective")
    if dist.get_rank() == 0:
        problems += [
            "save: " + p for p in diff_state_dicts(sg.load_file(path), plain_sd, order=False)
        ]
    sg.load_full_state_dict(model, path)
    return problems


@contextlib.contextmanager
def _fault_on_rank1(rank: int, where: str, fault: Callable[[], None]) -> Iterator[None]:
    """On rank 1, run ``fault()`` (raise, sleep, die) at a point of a save: as it
    launches its third bucket (``collective``), as it plans its buckets (``plan``), or
    as it writes its pieces (``node-local``); repaired when the block ends."""
    from shardgather._engine import collective, run

    if rank != 1:
        yield
        return
    if where == "collective":
        owner, name = collective.BucketGathers, "launch"
    elif where == "plan":
        owner, name = run, "my_buckets"
    else:
        owner, name = run, "write_pieces"
    real = getattr(owner, name)

    def faulty(*a, **k):  # type: ignore[no-untyped-def]
        if where != "collective" or a[1] == 2:  # (self, i): the bucket index
            fault()
        return real(*a, **k)

    setattr(owner, name, faulty)
    try:
        yield
    finally:
        setattr(owner, name, real)


def _save(model, path: str, timeout_s: float, where: str) -> tuple[str | None, str, float]:  # type: ignore[no-untyped-def]
    transport = "node-local" if where == "node-local" else "collective"
    timeout = datetime.timedelta(seconds=timeout_s)
    return _timed(
        lambda: sg.save_full_state_dict(
            model, path, bucket_mb=0.002, timeout=timeout, transport=transport
        )
    )


def raises_mid_save_worker(rank: int, world: int, path: str, where: str) -> dict:  # type: ignore[type-arg]
    """Rank 1 raises in the middle of a collective save (its third bucket), or while
    planning its buckets, or while writing its pieces (node-local)."""

    def fault() -> None:
        if where == "node-local":
            raise OSError(28, "No space left on device (simulated)")
        raise RuntimeError(f"simulated failure ({where})")

    return _fail_then_recover(rank, world, path, where, fault, timeout_s=60)


def _fail_then_recover(  # type: ignore[no-untyped-def]
    rank: int, world: int, path: str, where: str, fault, timeout_s: float
) -> dict:  # type: ignore[type-arg]
    """Save with ``fault`` injected on rank 1 at ``where``; then, once every rank is back
    (a barrier on the default group, which shardgather's failure left untouched), the
    next calls must work."""
    model, plain = build("fsdp2", world, seed=0)
    with _fault_on_rank1(rank, where, fault):
        raised, message, spent = _save(model, path, timeout_s, where)
        leftovers = sorted(os.listdir(os.path.dirname(path)))
    dist.barrier()
    problems = _next_call_works(model, plain.state_dict(), path)
    return {
        "raised": raised,
        "message": message,
        "spent": spent,
        "leftovers": leftovers,
        "problems": problems,
    }


@pytest.mark.parametrize("where", ["collective", "plan", "node-local"])
def test_a_rank_raising_mid_save_fails_every_rank_at_once(tmp_path, where: str) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "m.safetensors")
    results = dist_harness.run(
        "tests.test_failures:raises_mid_save_worker", 2, timeout=240, path=path, where=where
    )
    for r in results:
        # The failing rank's own error, and everyone else's, name rank 1 and its error.
        assert r["raised"] is not None, r
        assert "rank 1" in r["message"] and "simulated" in r["message"], r
        assert r["raised"] == "CollectiveError", r
        # Not at the timeout: the latch tells every rank at once.
        assert r["spent"] < 15, r
        assert not r["problems"], r["problems"]
    # Nothing under the final name and no temporary: rank 0 removed its temporary file
    # before it raised (the failing rank may have looked before that); the directory
    # holds only what the next, successful save wrote.
    assert results[0]["leftovers"] == [], results[0]
    assert os.listdir(tmp_path) == ["m.safetensors"]


def stuck_mid_save_worker(rank: int, world: int, path: str, transport: str) -> dict:  # type: ignore[type-arg]
    """Rank 1 is alive but stuck (a slow disk, a debugger) past the timeout in the
    middle of a save; when it comes back, it raises too, and the next calls work."""
    timeout_s, stuck_s = 4, 9
    # Rank 0 gives up long before rank 1 comes back; the barrier waits for it.
    result = _fail_then_recover(
        rank, world, path, transport, lambda: time.sleep(stuck_s), timeout_s=timeout_s
    )
    return {**result, "timeout": timeout_s, "stuck": stuck_s}


@pytest.mark.parametrize("transport", ["collective", "node-local"])
def test_a_stuck_rank_fails_every_rank_within_the_timeout(tmp_path, transport: str) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "m.safetensors")
    r0, r1 = dist_harness.run(
        "tests.test_failures:stuck_mid_save_worker", 2, timeout=240, path=path, transport=transport
    )
    # Rank 0 gives up after the timeout, naming rank 1; it does not wait for rank 1.
    assert r0["raised"] == "CollectiveError" and "rank 1" in r0["message"], r0
    assert r0["timeout"] <= r0["spent"] < r0["timeout"] + SLACK_S, r0
    assert r0["spent"] < r0["stuck"], r0
    # Rank 1, back, learns that the call failed (rank 0 gave up) and raises too.
    assert r1["raised"] == "CollectiveError" and "rank 0" in r1["message"], r1
    for r in (r0, r1):
        assert not r["problems"], r["problems"]  # the same processes: the next calls work
    assert r0["leftovers"] == []


def dies_mid_save_worker(rank: int, world: int, path: str, transport: str) -> dict:  # type: ignore[type-arg]
    model, _ = build("fsdp2", world, seed=0)
    timeout_s = 20
    with _fault_on_rank1(rank, transport, lambda: os._exit(3)):
        raised, message, spent = _save(model, path, timeout_s, transport)
    return {
        "raised": raised,
        "message": message,
        "spent": spent,
        "leftovers": sorted(os.listdir(os.path.dirname(path))),
        "timeout": timeout_s,
    }


@pytest.mark.parametrize("transport", ["collective", "node-local"])
def test_a_rank_dying_mid_save_fails_the_others_within_the_timeout(
    tmp_path, transport: str
) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "m.safetensors")
    r0, _ = dist_harness.run(
        "tests.test_failures:dies_mid_save_worker",
        2,
        timeout=240,
        path=path,
        transport=transport,
        _allow_missing=(1,),
    )
    assert r0["raised"] == "CollectiveError" and "rank 1" in r0["message"], r0
    assert r0["spent"] < r0["timeout"] + SLACK_S, r0
    assert r0["leftovers"] == [], r0


# ------------------------------------------------------------------ what a call costs


_TORCH_COLLECTIVES = (
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "barrier",
    "monitored_barrier",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "broadcast",
    "gather",
    "scatter",
    "reduce",
    "all_to_all",
    "send",
    "recv",
    "isend",
    "irecv",
    "new_group",
)


def counting_worker(rank: int, world: int, path: str) -> dict:  # type: ignore[type-arg]
    """Rounds and torch collectives of the first and of repeated calls, on one host."""
    from shardgather import _dist

    model, _ = build("fsdp2", world, seed=0)
    counts = {name: 0 for name in _TORCH_COLLECTIVES}
    for name in _TORCH_COLLECTIVES:
        real = getattr(dist, name)

        def counted(*a, real=real, name=name, **k):  # type: ignore[no-untyped-def]
            counts[name] += 1
            return real(*a, **k)

        setattr(dist, name, counted)

    def measure(fn) -> dict:  # type: ignore[no-untyped-def,type-arg]
        before = dict(counts)
        with _dist.counting() as c:
            fn()
        return {"rounds": c["rounds"], "torch": sum(counts[k] - before[k] for k in counts)}

    out = {}
    for verb, fn in {
        "full_state_dict": lambda: sg.full_state_dict(model),
        "save_full_state_dict": lambda: sg.save_full_state_dict(model, path),
        "load_full_state_dict": lambda: sg.load_full_state_dict(model, path),
    }.items():
        out[verb] = [measure(fn) for _ in range(3)]
    gatherer = sg.Gatherer(model)
    out["Gatherer.full_state_dict"] = [measure(gatherer.full_state_dict) for _ in range(3)]
    gatherer.close()
    return out


def test_repeated_calls_on_one_host_take_at_most_three_rounds_and_no_collective(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = dist_harness.run(
        "tests.test_failures:counting_worker", 2, path=str(tmp_path / "m.safetensors")
    )
    for r in results:
        for verb, calls in r.items():
            first, *repeated = calls
            for c in repeated:
                # Plan agreement (+ hand-off), completion, and for a file its publication.
                assert c["rounds"] <= 3 and c["torch"] == 0, (verb, calls)
            # The first call of the job too: hosts and the memfd probe are facts each
            # rank posts, not rounds.
            assert first["rounds"] <= 3 and first["torch"] == 0, (verb, calls)
        assert r["full_state_dict"][1]["rounds"] == 2, r
        assert r["Gatherer.full_state_dict"][1]["rounds"] == 2, r
        assert r["save_full_state_dict"][1]["rounds"] == 3, r


def wrong_calls_worker(rank: int, world: int, path: str) -> dict:  # type: ignore[type-arg]
    """The two commonest collective mistakes: one rank calls a verb (``if rank == 0:
    sg.save...``) and the ranks call different verbs."""
    model, _ = build("fsdp2", world, seed=0)
    long = datetime.timedelta(seconds=120)  # the data timeout: the mistake must not wait for it
    previous = sg.set_arrival_timeout(2)
    out: dict = {"default": previous.total_seconds()}
    # 1. Only rank 0 saves; rank 1 is busy elsewhere (not in any shardgather call).
    if rank == 0:
        out["one_rank"] = _timed(lambda: sg.save_full_state_dict(model, path, timeout=long))
    else:
        time.sleep(6)
        # It then makes the same call late: the call failed already, it learns so at once.
        out["late"] = _timed(lambda: sg.save_full_state_dict(model, path, timeout=long))
    # Both out of case 1 before case 2 starts: else, on a loaded machine, rank 0 may look
    # while rank 1 is still in its late call #0 and (rightly) report that instead.
    dist.barrier()
    # 2. Rank 0 saves, rank 1 loads.
    if rank == 0:
        out["different"] = _timed(lambda: sg.save_full_state_dict(model, path, timeout=long))
    else:
        out["different"] = _timed(lambda: sg.load_full_state_dict(model, path, timeout=long))
    sg.set_arrival_timeout(previous)
    # 3. Then the same calls on every rank work.
    sg.save_full_state_dict(model, path)
    sg.load_full_state_dict(model, path)
    out["leftovers"] = sorted(os.listdir(os.path.dirname(path)))
    return out


def test_one_rank_calling_or_ranks_in_different_verbs_are_named_within_the_arrival_bound(
    tmp_path,
) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "m.safetensors")
    r0, r1 = dist_harness.run("tests.test_failures:wrong_calls_worker", 2, timeout=240, path=path)
    assert r0["default"] == 60.0
    cls, msg, spent = r0["one_rank"]
    assert cls == "CollectiveError", r0
    assert "rank 1 is not in any shardgather call" in msg, msg
    assert "every rank of the process group must make the same shardgather calls" in msg, msg
    assert "if rank == 0: sg.save_full_state_dict(...)" in msg and "set_arrival_timeout" in msg
    # Regression: it said "failed on every rank" (rank 1 never called), named an internal
    # step ('host ids'), and ended with "stuck, or dead".
    assert "failed on every rank" not in msg and "stuck, or dead" not in msg, msg
    assert "'host" not in msg and "'plan'" not in msg, msg
    assert spent < 60, spent  # the arrival bound (2 s), not the call's 120 s
    assert r1["late"][0] == "CollectiveError" and "rank 0" in r1["late"][1], r1
    for r in (r0, r1):
        cls, msg, spent = r["different"]
        assert cls == "CollectiveError", r
        assert "different shardgather calls" in msg, msg
        assert "save_full_state_dict" in msg and "load_full_state_dict" in msg, msg
        assert spent < 60, spent
    assert r0["leftovers"] == ["m.safetensors"], r0


def different_paths_worker(rank: int, world: int, tmp: str) -> dict:  # type: ignore[type-arg]
    """Each rank passes its own path: an error naming both, on every rank, nothing
    written (it was rank 0's path, silently)."""
    model, _ = build("fsdp2", world, seed=0)
    out = {}
    for verb, fn in {
        "save": lambda: sg.save_full_state_dict(model, os.path.join(tmp, f"m{rank}.safetensors")),
        "save-collective": lambda: sg.save_full_state_dict(
            model, os.path.join(tmp, f"c{rank}.safetensors"), transport="collective"
        ),
        "checkpoint": lambda: sg.save_checkpoint(os.path.join(tmp, f"ckpt{rank}"), model),
    }.items():
        out[verb] = _timed(fn)[:2]
    dist.barrier()
    out["left"] = sorted(os.listdir(tmp))
    sg.save_full_state_dict(model, os.path.join(tmp, "same.safetensors"))  # then it works
    return out


def test_ranks_passing_different_paths_get_an_error_naming_both(tmp_path) -> None:  # type: ignore[no-untyped-def]
    r0, r1 = dist_harness.run(
        "tests.test_failures:different_paths_worker", 2, timeout=240, tmp=str(tmp_path)
    )
    for verb, stem in (("save", "m"), ("save-collective", "c"), ("checkpoint", "ckpt")):
        for r in (r0, r1):
            cls, msg = r[verb]
            assert cls == "CollectiveError" and "ranks passed different paths" in msg, (verb, r)
            assert f"{stem}0" in msg and f"{stem}1" in msg, msg  # both paths named
    assert r0["left"] == [], r0["left"]  # nothing written, no temporaries
    assert sorted(os.listdir(tmp_path)) == ["same.safetensors"]


def different_rounds_worker(rank: int, world: int) -> dict:  # type: ignore[type-arg]
    """Two ranks whose calls take different steps (a bug of shardgather's, were it to
    happen): one error naming both rounds, never one round's payload read as another's."""
    from shardgather._dist import Call

    timeout = datetime.timedelta(seconds=30)

    def steps() -> None:
        with Call("full_state_dict", timeout) as call:
            call.round("plan", same="fingerprint", payload="plan payload", gather="rank0")
            if rank == 0:
                call.round("done")
            else:
                call.round("host ids", payload=("host", None), gather="all")

    out = {"raised": _timed(steps)[:2]}
    dist.barrier()
    with Call("full_state_dict", timeout) as call:  # the next call works
        out["next"] = call.round("plan", payload=rank, gather="all")
    return out


def test_ranks_on_different_rounds_get_one_error_naming_both() -> None:
    for r in dist_harness.run("tests.test_failures:different_rounds_worker", 2, timeout=120):
        cls, msg = r["raised"]
        assert cls == "CollectiveError" and "took different steps" in msg, r
        assert "'done'" in msg and "'host ids'" in msg, msg
        assert r["next"] == [0, 1], r
