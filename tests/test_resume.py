"""save_checkpoint / load_checkpoint across world sizes and FSDP flavours, and into a
plain model in one process (evaluate or fine-tune what FSDP trained)."""

from __future__ import annotations

import os

import pytest
import torch

import shardgather as sg

from . import dist_harness
from .builders import build, same_osd
from .compare import diff_state_dicts
from .models import TinyLM, make_optimizer, train_steps

pytestmark = pytest.mark.distributed

MOVES = {
    # id: (save world, save kind, load world, load kind)
    "fsdp1_w2->fsdp2_w3": (2, "fsdp1", 3, "fsdp2"),
    "fsdp2_w2->fsdp1_orig_w3": (2, "fsdp2", 3, "fsdp1-orig"),
    "fsdp1_orig_w3->hsdp_w4": (3, "fsdp1-orig", 4, "fsdp2-hsdp"),
}


def ckpt_save(rank: int, world: int, path: str, kind: str) -> dict:  # type: ignore[type-arg]
    """Train, save_checkpoint; return (rank 0) what was saved, for the loading side."""
    model, _ = build(kind, world, seed=0)
    opt = make_optimizer(model, "adamw")
    train_steps(model, rank, 2, opt)
    sg.save_checkpoint(path, model, opt, extra={"step": 2, "note": "hi"})
    sd = sg.full_state_dict(model)
    osd = sg.full_optim_state_dict(model, opt)
    return {"sd": sd, "osd": osd}


def ckpt_load(  # type: ignore[no-untyped-def]
    rank: int,
    world: int,
    path: str,
    kind: str,
    saved_path: str,
    where="every rank",
    transport="auto",
) -> dict:  # type: ignore[type-arg]
    """A fresh model at another world size/flavour loads the checkpoint and trains on.
    ``where="rank 0"``: the directory is on rank 0's own disk (another path elsewhere):
    rank 0 sends each rank its elements (only those) and the metadata and ``extra``."""
    from shardgather import _dist

    saved = torch.load(saved_path, weights_only=False)
    model, _ = build(kind, world, seed=1)
    opt = make_optimizer(model, "adamw")
    if where == "rank 0" and rank != 0:
        path += ".elsewhere"
    before = _dist.STATS["bytes_received"]
    extra = sg.load_checkpoint(path, model, opt, transport=transport)
    received = _dist.STATS["bytes_received"] - before
    sd = sg.full_state_dict(model)
    osd = sg.full_optim_state_dict(model, opt)
    problems: list[str] = []
    # Model + AdamW's two states, as rank 0 holds them; a rank receives its own part.
    total = 3 * sum(v.numel() * v.element_size() for v in saved["sd"].values())
    sent = where == "rank 0" or transport == "collective"
    if rank != 0 and not (0 < received < 0.6 * total if sent else received == 0):
        problems.append(f"rank {rank} received {received} of {total} bytes (sent: {sent})")
    if rank == 0:
        problems += ["model: " + p for p in diff_state_dicts(sd, saved["sd"], order=False)]
        problems += ["optim: " + p for p in same_osd(osd, saved["osd"], exact=True)]
        if extra != {"step": 2, "note": "hi"}:
            problems.append(f"extra {extra}")
    train_steps(model, rank, 1, opt, start=2)
    return {"problems": problems}


@pytest.mark.parametrize("move", list(MOVES))
def test_checkpoint_moves_between_world_sizes_and_flavours(move: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    w1, k1, w2, k2 = MOVES[move]
    ckpt = str(tmp_path / "ckpt")
    saved = dist_harness.run("tests.test_resume:ckpt_save", w1, path=ckpt, kind=k1)[0]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporaries left
    assert sorted(os.listdir(ckpt)) == [
        "extra.pt",
        "model.safetensors",
        "optim.json",
        "optim.safetensors",
    ]
    torch.save(saved, tmp_path / "saved.pt")
    results = dist_harness.run(
        "tests.test_resume:ckpt_load", w2, path=ckpt, kind=k2, saved_path=str(tmp_path / "saved.pt")
    )
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)

    # ... and into the plain model, in this (single, no process group) process.
    torch.manual_seed(5)
    plain = TinyLM()
    opt = make_optimizer(plain)
    extra = sg.load_checkpoint(ckpt, plain, opt)
    assert extra["step"] == 2
    assert not diff_state_dicts(plain.state_dict(), saved["sd"], order=False)
    exp_avg = opt.state[plain.embed.weight]["exp_avg"]
    assert torch.equal(exp_avg, saved["osd"]["state"]["embed.weight"]["exp_avg"])


@pytest.mark.parametrize(
    "where, transport, kind",
    [("rank 0", "auto", "fsdp1-orig"), ("every rank", "collective", "fsdp2")],
)
def test_checkpoint_on_rank0_only_loads_everywhere(where, transport, kind, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A checkpoint on rank 0's own disk (or transport="collective"): rank 0 reads and
    sends each rank its elements, the optimizer's skeleton and ``extra``; bit-exact."""
    ckpt = str(tmp_path / "ckpt")
    saved = dist_harness.run("tests.test_resume:ckpt_save", 2, path=ckpt, kind="fsdp2")[0]
    torch.save(saved, tmp_path / "saved.pt")
    results = dist_harness.run(
        "tests.test_resume:ckpt_load",
        3,
        path=ckpt,
        kind=kind,
        saved_path=str(tmp_path / "saved.pt"),
        where=where,
        transport=transport,
    )
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)


def load_with_other_groups_on_rank1(rank: int, world: int, path: str, verb: str) -> dict:  # type: ignore[type-arg]
    """Rank 1 builds its optimizer with one param group (the checkpoint has two) and
    holds nothing to load (cannot see the directory; ``{}`` for the osd), so it could
    only find out from rank 0's skeleton: every rank raises in the plan round, before
    any shard or optimizer changes (without that check: a hang until the timeout)."""
    osd = {}
    if verb == "load_full_optim_state_dict":
        trained, _ = build("fsdp2", world, seed=0)
        topt = make_optimizer(trained, "adamw")
        train_steps(trained, rank, 1, topt)
        osd = sg.full_optim_state_dict(trained, topt)
    model, _ = build("fsdp2", world, seed=1)
    before = {k: v.clone() for k, v in sg.full_state_dict(model, rank0_only=False).items()}
    if rank == 1:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        path += ".elsewhere"
    else:
        opt = make_optimizer(model, "adamw")
    try:
        if verb == "load_checkpoint":
            sg.load_checkpoint(path, model, opt)
        else:
            sg.load_full_optim_state_dict(model, opt, osd if rank == 0 else {})
        error = None
    except sg.ShardGatherError as exc:
        error = f"{type(exc).__name__}: {exc}"
    after = sg.full_state_dict(model, rank0_only=False)
    return {
        "error": error,
        "unchanged": all(torch.equal(before[k], after[k]) for k in before),
        "optimizer empty": not opt.state,
    }


@pytest.mark.parametrize("verb", ["load_checkpoint", "load_full_optim_state_dict"])
def test_optimizer_groups_differing_across_ranks_change_nothing(verb: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ckpt = str(tmp_path / "ckpt")
    if verb == "load_checkpoint":
        dist_harness.run("tests.test_resume:ckpt_save", 2, path=ckpt, kind="fsdp2")
    results = dist_harness.run(
        "tests.test_resume:load_with_other_groups_on_rank1", 2, path=ckpt, verb=verb, timeout=120
    )
    for r in results:
        assert r["error"] is not None and "param groups" in r["error"], r
        assert r["unchanged"] and r["optimizer empty"], r


def test_not_a_checkpoint_dir(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(sg.CheckpointError, match="not a shardgather checkpoint"):
        sg.load_checkpoint(tmp_path, TinyLM())
