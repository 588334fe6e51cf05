"""Accelerate 1.15, for real (2 CPU processes: Accelerate then wraps in DDP — its FSDP
plugin needs GPUs): an ``accelerator.prepare``d model and optimizer go straight into
shardgather, with the keys and values of ``accelerator.get_state_dict``, and resume
bit-exactly from a shardgather checkpoint."""

from __future__ import annotations

import os

import pytest
import torch

import shardgather as sg

from . import dist_harness
from .compare import diff_state_dicts
from .models import TinyLM, make_optimizer, train_steps

pytest.importorskip("accelerate")
pytestmark = pytest.mark.distributed


def _prepared(seed: int):  # type: ignore[no-untyped-def]
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(seed)
    model = TinyLM()
    opt = make_optimizer(model)
    model, opt = accelerator.prepare(model, opt)
    return accelerator, model, opt


def accelerate_worker(rank: int, world: int, ckpt: str) -> dict:  # type: ignore[type-arg]
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1"
    )
    os.environ.setdefault("MASTER_PORT", "1")  # the process group already exists
    accelerator, model, opt = _prepared(seed=0)
    problems: list[str] = []
    train_steps(model, rank, 2, opt)
    want = accelerator.get_state_dict(model)  # Accelerate's own full, unwrapped dict
    got = sg.full_state_dict(model)
    if rank == 0:
        problems += ["vs accelerate: " + p for p in diff_state_dicts(got, want)]
    sg.save_checkpoint(ckpt, model, opt, extra={"step": 2})
    train_steps(model, rank, 2, opt, start=2)
    final = sg.full_state_dict(model)

    _, fresh, fresh_opt = _prepared(seed=1)
    extra = sg.load_checkpoint(ckpt, fresh, fresh_opt)
    train_steps(fresh, rank, 2, fresh_opt, start=extra["step"])
    resumed = sg.full_state_dict(fresh)
    if rank == 0:
        problems += ["resumed: " + p for p in diff_state_dicts(resumed, final)]
    return {"problems": problems}


def test_accelerate_prepared_model_and_optimizer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = dist_harness.run(
        "tests.test_accelerate:accelerate_worker", 2, ckpt=str(tmp_path / "ckpt")
    )
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    plain = TinyLM()
    plain.load_state_dict(sg.load_file(tmp_path / "ckpt" / "model.safetensors"), strict=True)
