"""save_full_state_dict -> safetensors -> load_full_state_dict, across FSDP versions
and world sizes, in real gloo processes; bad files and failures lose nothing."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import shardgather as sg

from . import dist_harness
from .builders import build, io_read_bytes
from .compare import diff_state_dicts
from .models import TinyLM, make_optimizer, train_steps

pytestmark = pytest.mark.distributed

ROUND_TRIPS = {
    # id: (world, save kind, load kind, extra kwargs)
    "fsdp1->fsdp1": (2, "fsdp1", "fsdp1", {}),
    "fsdp1->fsdp2": (2, "fsdp1", "fsdp2", {}),
    "fsdp2->fsdp1_orig": (2, "fsdp2", "fsdp1-orig", {}),
    "fsdp1-world3->fsdp2-world3": (3, "fsdp1", "fsdp2", {}),
    "fsdp2->hsdp": (4, "fsdp2", "fsdp2-hsdp", {}),
    "fsdp1->plain": (2, "fsdp1", "plain", {}),
    "bf16_export->fsdp2": (2, "fsdp1", "fsdp2", {"dtype": torch.bfloat16}),
    "small_bucket": (2, "fsdp2", "fsdp1", {"small_bucket": True, "transport": "collective"}),
    "collective-fsdp1->fsdp2": (2, "fsdp1", "fsdp2", {"transport": "collective"}),
    "collective-bf16_export": (
        2,
        "fsdp2",
        "fsdp1",
        {"transport": "collective", "dtype": torch.bfloat16},
    ),
    "collective-hsdp->fsdp1": (4, "fsdp2-hsdp", "fsdp1", {"transport": "collective"}),
}


def save_then_load(
    rank: int,
    world: int,
    path: str,
    save_kind: str,
    load_kind: str,
    dtype: torch.dtype | None = None,
    small_bucket: bool = False,
    transport: str = "auto",
) -> dict:  # type: ignore[type-arg]
    """Save from one configuration (seed 0, trained), load into another (seed 1), and
    compare what the loaded model gathers with what was saved."""
    saved, _ = build(save_kind, world, seed=0)
    opt = torch.optim.SGD(saved.parameters(), lr=0.1)
    train_steps(saved, rank, 1, opt)
    want = sg.full_state_dict(saved)
    sg.save_full_state_dict(
        saved,
        path,
        dtype=dtype,
        metadata={"step": "1"},
        bucket_mb=0.001 if small_bucket else None,
        transport=transport,
    )
    problems: list[str] = []
    if rank == 0:
        from safetensors.torch import load_file

        raw = load_file(path)  # safetensors itself reads it
        file_sd = sg.load_file(path)
        want_file = {
            k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v)
            for k, v in want.items()
        }
        problems += ["file: " + p for p in diff_state_dicts(file_sd, want_file, order=False)]
        if "lm_head.weight" in raw:
            problems.append("tied weight stored twice")
    loaded, _ = build(load_kind, world, seed=1)
    res = sg.load_full_state_dict(loaded, path)
    got = sg.full_state_dict(loaded)
    if rank == 0:
        expect = (
            want
            if dtype is None
            else {
                k: (v.to(dtype).to(v.dtype) if v.is_floating_point() else v)
                for k, v in want.items()
            }
        )
        problems += ["loaded: " + p for p in diff_state_dicts(got, expect, order=False)]
        problems += [f"unexpected result {res}"] if res.missing_keys or res.unexpected_keys else []
    # The loaded model trains.
    train_steps(loaded, rank, 1, torch.optim.SGD(loaded.parameters(), lr=0.1))
    return {"problems": problems}


def load_errors(rank: int, world: int, path: str) -> dict:  # type: ignore[type-arg]
    """Bad files and mismatches raise clear errors and modify nothing."""
    import os

    model, _ = build("fsdp1", world, seed=0)
    before = sg.full_state_dict(model, rank0_only=False)
    out: dict = {}
    torch.manual_seed(3)
    sg.save_full_state_dict(TinyLM(n_layers=4), path)  # blocks.3.* are unexpected
    for name, fn in {
        "unexpected_key": lambda: sg.load_full_state_dict(model, path),
        "missing_file": lambda: sg.load_full_state_dict(model, path + ".nope"),
    }.items():
        try:
            fn()
            out[name] = None
        except sg.ShardGatherError as exc:
            out[name] = (type(exc).__name__, str(exc))
    after = sg.full_state_dict(model, rank0_only=False)
    out["unchanged_by_errors"] = not diff_state_dicts(after, before)
    res = sg.load_full_state_dict(model, path, strict=False)
    out["non_strict"] = (res.missing_keys, res.unexpected_keys)
    loaded = sg.full_state_dict(model, rank0_only=False)
    torch.manual_seed(3)
    want = TinyLM(n_layers=4).state_dict()
    out["non_strict_loaded"] = not diff_state_dicts(
        loaded, {k: v for k, v in want.items() if k in loaded}, order=False
    )
    if rank == 0:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 10)
    dist.barrier()
    try:
        sg.load_full_state_dict(model, path)
        out["truncated"] = None
    except sg.ShardGatherError as exc:
        out["truncated"] = (type(exc).__name__, str(exc))
    return out


def save_fails_on_one_rank(rank: int, world: int, path: str, transport: str) -> dict:  # type: ignore[type-arg]
    """The writer's disk fills up mid-stream: every rank raises, nothing is left."""
    import errno
    import os

    from shardgather._engine import pieces, sinks
    from shardgather._plan import build_plan

    model, _ = build("fsdp1", world, seed=0)
    if rank == 0:
        # Fail on the second write of gathered data (a bucket on the collective path, a
        # piece on the node-local one), after the unsharded entries went through.
        unsharded = sum(1 for e in build_plan(model).entries.values() if e.source.group is None)
        calls = [0]

        def full_disk(real):  # type: ignore[no-untyped-def]
            def write(*a, **k):  # type: ignore[no-untyped-def]
                calls[0] += 1
                if calls[0] > unsharded + 1:
                    raise OSError(errno.ENOSPC, "No space left on device (simulated)")
                return real(*a, **k)

            return write

        sinks.pwrite_from = full_disk(sinks.pwrite_from)
        pieces.pwrite_from = full_disk(pieces.pwrite_from)
    try:
        if transport == "auto-directory":
            sg.save_full_state_dict(model, path, bucket_mb=0.001, max_shard_size=2000)
        else:
            sg.save_full_state_dict(model, path, bucket_mb=0.001, transport=transport)
        raised = None
    except sg.ShardGatherError as exc:
        raised = (type(exc).__name__, str(exc))
    leftovers = sorted(os.listdir(os.path.dirname(path)))
    return {"raised": raised, "leftovers": leftovers, "writes": calls[0] if rank == 0 else None}


def save_into_missing_dir(rank: int, world: int, path: str, transport: str) -> dict:  # type: ignore[type-arg]
    """Rank 0 cannot create the file (no such directory): every rank raises the same
    CheckpointError at once, none is left waiting in a collective."""
    import datetime

    model, _ = build("fsdp2", world, seed=0)
    timeout = datetime.timedelta(seconds=60)
    try:
        if transport == "checkpoint":
            sg.save_checkpoint(path, model, timeout=timeout)
        else:
            sg.save_full_state_dict(model, path, transport=transport, timeout=timeout)
        return {"raised": None}
    except sg.ShardGatherError as exc:
        return {"raised": (type(exc).__name__, str(exc))}


def load_sources(rank: int, world: int, path: str, load_kind: str = "fsdp2") -> dict:  # type: ignore[type-arg]
    """load_full_state_dict from a torch file (mmap), a dict on every rank, a dict on
    rank 0 only, and files only rank 0 can see; each into a fresh FSDP model,
    bit-exact, and where rank 0 sends, each rank receives only its own elements."""
    saved, _ = build("fsdp1", world, seed=0)
    train_steps(saved, rank, 1, torch.optim.SGD(saved.parameters(), lr=0.1))
    want = sg.full_state_dict(saved, rank0_only=False, transport="collective")
    if rank == 0:
        # As DDP users save it: wrapped names, which loading cleans.
        torch.save({"state_dict": {"module." + k: v for k, v in want.items()}}, path)
    dist.barrier()
    problems: list[str] = []
    from shardgather import _dist

    st_path = path + ".safetensors"
    sg.save_full_state_dict(saved, st_path)
    for name, source in {
        "torch file": path,
        "dict on every rank": want,
        "dict on rank 0 only": want if rank == 0 else {},
        # A file on rank 0's own disk: the other ranks cannot see it (another path here).
        "torch file only rank 0 sees": path if rank == 0 else path + ".elsewhere",
        "safetensors only rank 0 sees": st_path if rank == 0 else st_path + ".elsewhere",
    }.items():
        model, _ = build(load_kind, world, seed=1)
        before = _dist.STATS["bytes_received"]
        res = sg.load_full_state_dict(model, source)
        received = _dist.STATS["bytes_received"] - before
        if "rank 0" in name and rank != 0:
            # Only this rank's elements travel to it, not every tensor.
            total = sum(
                v.numel() * v.element_size() for k, v in want.items() if k != "lm_head.weight"
            )
            if not 0 < received < 0.6 * total:
                problems.append(f"{name}: rank {rank} received {received} of {total} bytes")
        got = sg.full_state_dict(model)
        if rank == 0:
            problems += [f"{name}: " + p for p in diff_state_dicts(got, want, order=False)]
            if res.missing_keys or res.unexpected_keys:
                problems.append(f"{name}: {res}")
    return {"problems": problems}


def load_reads_only_own_bytes(rank: int, world: int, path: str, kind: str) -> dict:  # type: ignore[type-arg]
    """Loading a safetensors file, a rank reads its own elements' bytes (plus the
    header and the tensors every rank holds in full), not the file."""
    from shardgather._engine.pieces import pieces_of
    from shardgather._plan import build_plan
    from shardgather.testing import Block as GPTBlock
    from shardgather.testing import build_gpt

    model = build_gpt(0.1)
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FSDP(
            model, auto_wrap_policy=ModuleWrapPolicy({GPTBlock}), device_id=torch.device("cpu")
        )
    else:
        from torch.distributed.fsdp import fully_shard

        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
    sg.save_full_state_dict(model, path)
    plan = build_plan(model)
    own = sum(e.nbytes for e in plan.entries.values() if e.source.group is None)
    own += sum(pc.numel * pc.entry.dtype.itemsize for pc in pieces_of(plan, lambda i: True))
    before = io_read_bytes()
    sg.load_full_state_dict(model, path)
    read = io_read_bytes() - before
    import os

    return {"read": read, "own": own, "file": os.path.getsize(path)}


@pytest.mark.parametrize("case", list(ROUND_TRIPS))
def test_round_trip(case: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    world, save_kind, load_kind, kw = ROUND_TRIPS[case]
    path = str(tmp_path / "model.safetensors")
    results = dist_harness.run(
        "tests.test_checkpoint:save_then_load",
        world,
        path=path,
        save_kind=save_kind,
        load_kind=load_kind,
        **kw,
    )
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]  # no temp files left


def test_load_errors_are_clear_and_lose_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "other.safetensors")
    r = dist_harness.run("tests.test_checkpoint:load_errors", 2, path=path)[0]
    assert r["unexpected_key"][0] == "StateDictMismatchError"
    assert "unexpected keys ['blocks.3." in r["unexpected_key"][1]
    assert r["missing_file"][0] == "CheckpointError" and "no such file" in r["missing_file"][1]
    assert r["unchanged_by_errors"]
    assert r["non_strict"][0] == [] and all(k.startswith("blocks.3.") for k in r["non_strict"][1])
    assert r["non_strict_loaded"]
    assert r["truncated"][0] == "CheckpointError" and "truncated" in r["truncated"][1]


@pytest.mark.parametrize("transport", ["auto", "collective", "auto-directory"])
def test_failed_save_on_one_rank_leaves_nothing(tmp_path, transport) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "model.safetensors")
    if transport == "auto-directory":  # the Hugging Face layout, several files
        path = str(tmp_path / "hf")
    results = dist_harness.run(
        "tests.test_checkpoint:save_fails_on_one_rank", 2, path=path, transport=transport
    )
    for r in results:
        assert r["raised"] is not None and "No space left" in r["raised"][1], r
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("transport", ["auto", "collective", "checkpoint"])
def test_save_where_rank0_cannot_create_raises_on_every_rank(tmp_path, transport) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "blocker").write_text("a file where a directory should be")
    path = str(tmp_path / "blocker" / "model.safetensors")
    results = dist_harness.run(
        "tests.test_checkpoint:save_into_missing_dir",
        2,
        path=path,
        transport=transport,
        timeout=120,
    )
    for r in results:
        assert r["raised"] is not None and r["raised"][0] == "CheckpointError", r
        assert "directory exists" in r["raised"][1], r
    assert os.listdir(tmp_path) == ["blocker"]


def test_plain_model_round_trip_single_process(tmp_path) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = TinyLM()
    path = tmp_path / "m.safetensors"
    sg.save_full_state_dict(model, path)
    fresh = TinyLM()
    fresh.load_state_dict(sg.load_file(path))
    assert not diff_state_dicts(fresh.state_dict(), model.state_dict())


def test_strict_false_with_no_matching_name_is_an_error_not_a_silent_no_op(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Regression: strict=False on a file none of whose names are the model's loaded
    nothing and returned as if it had."""
    import safetensors.torch

    torch.manual_seed(0)
    model = TinyLM()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    path = tmp_path / "other.safetensors"
    prefixed = {f"model.{k}": v.clone() + 1 for k, v in model.state_dict().items()}
    safetensors.torch.save_file(prefixed, str(path))
    with pytest.raises(sg.StateDictMismatchError, match="none of the model's") as e:
        sg.load_full_state_dict(model, path, strict=False)
    assert "nothing was loaded" in str(e.value) and "key_map" in str(e.value), str(e.value)
    assert not diff_state_dicts(model.state_dict(), before)
    # Some names matching: strict=False loads those and reports the rest, as before.
    some = {k: v + 1 for k, v in list(model.state_dict().items())[:2]}
    safetensors.torch.save_file(some, str(path))
    res = sg.load_full_state_dict(model, path, strict=False)
    assert res.missing_keys and torch.equal(
        model.state_dict()[next(iter(some))], next(iter(some.values()))
    )


@pytest.mark.parametrize(
    "garbage",
    [b"", b"abc", b"\xff" * 64, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}...."],
    ids=["empty", "short", "huge-header", "bad-json"],
)
def test_not_a_safetensors_file(tmp_path, garbage: bytes) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(garbage)
    with pytest.raises(sg.CheckpointError):
        sg.load_full_state_dict(TinyLM(), path)


def test_shape_mismatch_names_the_key_and_changes_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "m.safetensors"
    sg.save_full_state_dict(TinyLM(d=16), path)
    model = TinyLM()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(sg.StateDictMismatchError, match=r"embed\.weight: shape \(37, 16\)"):
        sg.load_full_state_dict(model, path)
    assert not diff_state_dicts(model.state_dict(), before)


@pytest.mark.parametrize(
    ("load_kind", "world"), [("fsdp2", 2), ("fsdp1-orig", 3), ("fsdp2-hsdp", 4)]
)
def test_load_from_torch_file_and_dicts(tmp_path, load_kind: str, world: int) -> None:  # type: ignore[no-untyped-def]
    results = dist_harness.run(
        "tests.test_checkpoint:load_sources",
        world,
        path=str(tmp_path / "model.pt"),
        load_kind=load_kind,
    )
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("kind", ["fsdp1", "fsdp2"])
def test_load_reads_only_each_ranks_own_bytes(tmp_path, kind: str) -> None:  # type: ignore[no-untyped-def]
    results = dist_harness.run(
        "tests.test_checkpoint:load_reads_only_own_bytes",
        2,
        path=str(tmp_path / "m.safetensors"),
        kind=kind,
    )
    for r in results:
        # Own elements + the header + collectives' small messages; never the whole file.
        assert r["own"] <= r["read"] <= r["own"] + 2**20, r
        assert r["own"] < 0.6 * r["file"], r


def progress_worker(rank: int, world: int, root: str) -> dict:  # type: ignore[type-arg]
    """Each verb's bar on rank 0: what the ranks counted before the done round forced
    the bar to its total (it must already be there) — for saves, loads, checkpoints."""
    from shardgather import _progress

    seen: list[tuple[str, int, int]] = []
    real_done = _progress.Progress.done

    def done(self):  # type: ignore[no-untyped-def]
        if self.bar is not None:
            seen.append((self.bar.desc, int(self.bar.n), self.base + self.part_total))
        real_done(self)

    _progress.Progress.done = done  # type: ignore[method-assign]
    model, _ = build("fsdp2", world, seed=0)
    opt = make_optimizer(model)
    train_steps(model, rank, 1, opt)
    path = os.path.join(root, "m.safetensors")
    sg.save_full_state_dict(model, path, progress=True)
    sg.load_full_state_dict(model, path, progress=True)
    sg.save_checkpoint(os.path.join(root, "ckpt"), model, opt, progress=True)
    sg.load_checkpoint(os.path.join(root, "ckpt"), model, opt, progress=True)
    sg.full_state_dict(model, progress=True, transport="collective")
    sg.full_optim_state_dict(model, opt, progress=True)  # it took no progress= before
    # blocking=False: the writer threads count (it showed nothing before); wait() ends it.
    ckpt = sg.save_checkpoint(os.path.join(root, "a"), model, opt, progress=True, blocking=False)
    ckpt.wait()
    sg.save_full_state_dict(model, path + ".a", progress=True, blocking=False).wait()
    return {"seen": seen}


def test_progress_counts_every_ranks_bytes_and_ends_at_the_total(tmp_path) -> None:  # type: ignore[no-untyped-def]
    r0, r1 = dist_harness.run("tests.test_checkpoint:progress_worker", 2, root=str(tmp_path))
    assert r1["seen"] == []  # one bar per job, on rank 0
    descs = [d for d, _, _ in r0["seen"]]
    assert descs == [
        "shardgather: save_full_state_dict",
        "shardgather: load_full_state_dict",
        "shardgather: save_checkpoint",  # the model
        "shardgather: save_checkpoint",  # the optimizer state
        "shardgather: load_checkpoint",
        "shardgather: full_state_dict",
        "shardgather: full_optim_state_dict",
        "shardgather: save_checkpoint",  # blocking=False: model and optimizer, one bar
        "shardgather: save_full_state_dict",  # blocking=False
    ], descs
    for desc, counted, total in r0["seen"]:
        assert total > 0 and counted == total, (desc, counted, total)
