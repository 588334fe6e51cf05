"""Full optimizer state: gathered bit-exactly (torch's FSDP2 oracle), and an exact
resume: train N+M steps == train N, save, rebuild, load, train M."""

from __future__ import annotations

import pytest
import torch

import shardgather as sg

from . import dist_harness
from .builders import build, eval_loss, same_osd
from .compare import diff_state_dicts
from .models import make_optimizer, train_steps

pytestmark = pytest.mark.distributed


OPTIM_CASES = {
    # id: (world, save kind, resume kind, optimizer)
    "fsdp1-adamw": (2, "fsdp1", "fsdp1", "adamw"),
    "fsdp1_orig-adamw": (2, "fsdp1-orig", "fsdp1-orig", "adamw"),
    "fsdp2-adamw": (2, "fsdp2", "fsdp2", "adamw"),
    "fsdp2-sgd_momentum": (2, "fsdp2", "fsdp2", "sgd"),
    "fsdp1-world3-adam": (3, "fsdp1", "fsdp1", "adam"),
    "fsdp1_orig-world3-sgd_momentum": (3, "fsdp1-orig", "fsdp1-orig", "sgd"),
    "hsdp-adamw": (4, "fsdp2-hsdp", "fsdp2-hsdp", "adamw"),
    "fsdp1->fsdp2-adamw": (2, "fsdp1-orig", "fsdp2", "adamw"),
    # Resume a sharded run as a DDP one (every rank loads the whole state).
    "fsdp2->ddp-adamw": (2, "fsdp2", "ddp", "adamw"),
    # A frozen bf16 parameter next to trainable fp32 ones: it has no optimizer state.
    "fsdp2_frozen_bf16-adamw": (2, "fsdp2-frozen", "fsdp2-frozen", "adamw"),
}


def optim_resume(rank: int, world: int, path: str, case: str) -> dict:  # type: ignore[type-arg]
    """Run A trains N+M steps; run B trains N, saves model + optimizer, is thrown away;
    a fresh model C (other seed) loads both and trains M: C must equal A."""
    _, save_kind, resume_kind, opt_name = OPTIM_CASES[case]
    exact = save_kind == resume_kind
    n, m = 2, 2
    a, _ = build(save_kind, world, seed=0)
    oa = make_optimizer(a, opt_name)
    train_steps(a, rank, n + m, oa)
    a_sd = sg.full_state_dict(a)
    a_osd = sg.full_optim_state_dict(a, oa)
    problems: list[str] = []
    if save_kind.startswith("fsdp2"):
        # torch's own full optimizer state dict as an oracle (FSDP2: correct on CPU).
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        ref = get_optimizer_state_dict(
            a, oa, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank == 0:
            problems += ["vs torch: " + p for p in same_osd(a_osd, ref, exact=True)]
    del a, oa

    b, _ = build(save_kind, world, seed=0)
    ob = make_optimizer(b, opt_name)
    train_steps(b, rank, n, ob)
    sg.save_full_state_dict(b, path)
    osd = sg.full_optim_state_dict(b, ob)  # rank 0 only: loading broadcasts it
    loss_at_save = eval_loss(b, rank, n)
    del b, ob

    c, _ = build(resume_kind, world, seed=1)
    oc = make_optimizer(c, opt_name)
    sg.load_full_state_dict(c, path)
    sg.load_full_optim_state_dict(c, oc, osd)
    loss_at_resume = eval_loss(c, rank, n)
    # Buffers (BatchNorm statistics) are per rank and a full state dict holds rank 0's,
    # so only rank 0 resumes with exactly its own buffers.
    if exact and rank == 0 and loss_at_resume != loss_at_save:
        problems.append(f"loss after resume {loss_at_resume} != at save {loss_at_save}")
    train_steps(c, rank, m, oc, start=n)
    c_sd = sg.full_state_dict(c)
    c_osd = sg.full_optim_state_dict(c, oc)
    if rank == 0:
        if exact:
            problems += ["model: " + p for p in diff_state_dicts(c_sd, a_sd)]
        else:
            for k, v in a_sd.items():
                if not torch.allclose(c_sd[k].double(), v.double(), atol=1e-5, rtol=1e-4):
                    problems.append(f"model {k} not close")
        problems += ["optim: " + p for p in same_osd(c_osd, a_osd, exact)]
    return {"problems": problems}


def optim_edge_cases(rank: int, world: int) -> dict:  # type: ignore[type-arg]
    """Before the first step: an empty state that loads; a mismatched checkpoint fails."""
    model, _ = build("fsdp2", world, seed=0)
    opt = make_optimizer(model, "adamw")
    osd = sg.full_optim_state_dict(model, opt, rank0_only=False)
    out: dict = {"empty_state": osd["state"] == {}, "groups": len(osd["param_groups"])}
    sg.load_full_optim_state_dict(model, opt, osd)
    bad = {
        "state": {},
        "param_groups": [dict(osd["param_groups"][0], params=["nope"]), osd["param_groups"][1]],
    }
    try:
        sg.load_full_optim_state_dict(model, opt, bad)
        out["mismatch"] = None
    except sg.StateDictMismatchError as exc:
        out["mismatch"] = str(exc)
    return out


@pytest.mark.parametrize("case", list(OPTIM_CASES))
def test_exact_resume(case: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    world = OPTIM_CASES[case][0]
    results = dist_harness.run(
        "tests.test_optim:optim_resume", world, path=str(tmp_path / "m.safetensors"), case=case
    )
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)


def test_before_first_step_and_mismatch() -> None:
    r = dist_harness.run("tests.test_optim:optim_edge_cases", 2)[0]
    assert r["empty_state"] and r["groups"] == 2
    assert r["mismatch"] is not None and "nope" in r["mismatch"]


def test_another_kind_of_optimizer_is_refused_before_anything_changes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An AdamW checkpoint into SGD(momentum=0.9): refused by name, in both verbs,
    instead of loading and failing at the next step with KeyError: 'momentum'."""
    from .models import TinyLM

    model = TinyLM(tied=False)
    adam = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 37, (2, 5))).float().pow(2).mean().backward()
    adam.step()
    sg.save_checkpoint(tmp_path / "ckpt", model, adam)
    osd = sg.full_optim_state_dict(model, adam)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    before = sgd.state_dict()
    with pytest.raises(sg.StateDictMismatchError, match=r"not a SGD.s.*betas.*momentum"):
        sg.load_full_optim_state_dict(model, sgd, osd)
    with pytest.raises(sg.StateDictMismatchError, match="same optimizer type"):
        sg.load_checkpoint(tmp_path / "ckpt", model, sgd)
    assert sgd.state_dict() == before
    # The same type with other settings values loads (the saved values win, as in torch).
    again = torch.optim.AdamW(model.parameters(), lr=5e-3)
    sg.load_checkpoint(tmp_path / "ckpt", model, again)
    assert again.param_groups[0]["lr"] == 1e-2
