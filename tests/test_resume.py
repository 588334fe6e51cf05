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


def ckpt_load(rank: int, world: int, path: str, kind: str, saved_path: str) -> dict:  # type: ignore[type-arg]
    """A fresh model at another world size/flavour loads the checkpoint and trains on."""
    saved = torch.load(saved_path, weights_only=False)
    model, _ = build(kind, world, seed=1)
    opt = make_optimizer(model, "adamw")
    extra = sg.load_checkpoint(path, model, opt)
    sd = sg.full_state_dict(model)
    osd = sg.full_optim_state_dict(model, opt)
    problems: list[str] = []
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


def test_not_a_checkpoint_dir(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(sg.CheckpointError, match="not a shardgather checkpoint"):
        sg.load_checkpoint(tmp_path, TinyLM())
