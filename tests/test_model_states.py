"""Every call works in every state a training loop leaves the model in — before the
first forward, after an evaluation under ``torch.no_grad()`` (FSDP2 then leaves the
root's parameters unsharded), after backward, after an optimizer step — for the model
and the optimizer state, FSDP1 and FSDP2, in real gloo processes."""

from __future__ import annotations

import pytest
import torch

import shardgather as sg

from . import dist_harness
from .compare import diff_state_dicts
from .models import batch, make_optimizer

pytestmark = pytest.mark.distributed


def _osd_problems(got: dict, want: dict) -> list[str]:  # type: ignore[type-arg]
    from .builders import same_osd

    return same_osd(got, want, exact=True)


def _torch_model_sd(model: torch.nn.Module) -> dict:  # type: ignore[type-arg]
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def _evaluate(model: torch.nn.Module, rank: int) -> None:
    model.eval()
    with torch.no_grad():
        model(batch(rank, 100))
    model.train()


def _outputs(model: torch.nn.Module, rank: int) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = model(batch(rank, 7))
    model.train()
    return out


def states_worker(rank: int, world: int, kind: str, path: str) -> dict:  # type: ignore[type-arg]
    from .builders import build

    model, _ = build(kind, world, seed=0)
    opt = make_optimizer(model, "adamw")
    problems: list[str] = []

    def check(state: str, want_sd: dict | None, want_osd: dict | None) -> tuple[dict, dict]:  # type: ignore[type-arg]
        sd = sg.full_state_dict(model)
        osd = sg.full_optim_state_dict(model, opt)
        ref = _torch_model_sd(model)
        if rank == 0:
            problems.extend(f"{state}: vs torch: {p}" for p in diff_state_dicts(sd, ref))
            if want_sd is not None:
                problems.extend(f"{state}: model: {p}" for p in diff_state_dicts(sd, want_sd))
            if want_osd is not None:
                problems.extend(f"{state}: optim: {p}" for p in _osd_problems(osd, want_osd))
        return sd, osd

    sd0, osd0 = check("before the first forward", None, None)
    if rank == 0 and osd0["state"]:
        problems.append("before the first step the optimizer state is not empty")
    _evaluate(model, rank)
    check("after a no_grad forward", sd0, osd0)
    model(batch(rank, 0)).float().pow(2).mean().backward()
    check("after backward", None, osd0)  # torch's dict is the oracle (BatchNorm stats moved)
    opt.step()
    opt.zero_grad()
    sd1, osd1 = check("after an optimizer step", None, None)
    if kind.startswith("fsdp2"):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        ref = get_optimizer_state_dict(
            model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank == 0:
            problems.extend(f"after a step: optim vs torch: {p}" for p in _osd_problems(osd1, ref))
    _evaluate(model, rank)
    check("after a step and a no_grad forward", sd1, osd1)
    sg.save_checkpoint(path, model, opt, extra={"step": 1})
    saved_out = _outputs(model, rank)

    fresh, _ = build(kind, world, seed=1)
    fresh_opt = make_optimizer(fresh, "adamw")
    _evaluate(fresh, rank)  # the loading side may have evaluated too
    extra = sg.load_checkpoint(path, fresh, fresh_opt)
    model, opt = fresh, fresh_opt
    check("loaded into a model after a no_grad forward", sd1, osd1)
    # What a user sees: the next forward computes with the loaded weights. (Rank 0
    # only: BatchNorm statistics are per rank, and the checkpoint holds rank 0's.)
    if not torch.equal(_outputs(model, rank), saved_out) and rank == 0:
        problems.append("a forward after loading does not use the loaded weights")
    if extra != {"step": 1}:
        problems.append(f"extra {extra}")
    return {"problems": problems}


@pytest.mark.parametrize("kind", ["fsdp1", "fsdp1-orig", "fsdp2"])
def test_every_training_state(kind: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = dist_harness.run(
        "tests.test_model_states:states_worker", 2, kind=kind, path=str(tmp_path / "ckpt")
    )
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
