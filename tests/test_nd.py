"""N-D layouts (issue 26): tensor parallel, FSDP2 over TP (2-D, bf16 compute), HSDP over
TP (3-D), TP with replicate, FSDP2 on dim 1, expert parallel — every verb, in real gloo
processes, bit-exact against the plain model, torch's own full state dict and
``DTensor.full_tensor()``. Loads are checked through each rank's local tensors: they
must equal those of the model that was saved (torch 2.14 itself cannot load a full
dict into FSDP2 x TP: ``set_model_state_dict`` asserts on ``_StridedShard``)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import shardgather as sg
from shardgather._dist import counting

from . import dist_harness
from .builders import ND_KINDS, build_nd, local_tensors
from .compare import diff_state_dicts
from .models import make_optimizer, train_steps

pytestmark = pytest.mark.distributed


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """torch's full state dict (every rank calls; rank 0 keeps it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def _optim_reference(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict]:  # type: ignore[type-arg]
    """Each parameter's element-wise optimizer state, made full by DTensor itself."""
    from shardgather import clean_fqn

    out = {}
    for name, p in model.named_parameters():
        st = opt.state.get(p, {})
        out[clean_fqn(name)] = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in st.items()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        }
    return out


def _local_optim(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    from shardgather import clean_fqn

    out = {}
    for name, p in model.named_parameters():
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                t = v.to_local() if hasattr(v, "to_local") else v
                out[f"{clean_fqn(name)}/{k}"] = t.detach().clone()
    return out


def _same(got: dict, want: dict, what: str) -> list[str]:  # type: ignore[type-arg]
    return [f"{what}: {p}" for p in diff_state_dicts(got, want, order=False, strides=False)]


def nd_case(rank: int, world: int, kind: str, tmp: str) -> dict:  # type: ignore[type-arg]
    """Every verb on one layout: gather (node-local, collective, every rank, bf16 cast),
    stream, save (file, HF directory, async) and load (each rank reading only its own
    bytes), optimizer state, checkpoints with an exact resume."""
    import datetime

    model, plain = build_nd(kind, seed=0)
    problems: list[str] = []
    want0 = plain.state_dict()
    # Before training: the plain model is the oracle.
    got = sg.full_state_dict(model)
    if rank == 0:
        problems += _same(got, want0, "before training")
        problems += [f"key order: {list(got)}"] if list(got) != list(want0) else []
    elif got != {}:
        problems.append(f"rank {rank} got a dict")
    every = sg.full_state_dict(model, rank0_only=False, transport="collective")
    params = {k for k, _ in plain.named_parameters()}
    problems += _same({k: every[k] for k in params}, {k: want0[k] for k in params}, "every rank")

    opt = make_optimizer(model)
    train_steps(model, 0, 2, opt)
    ref = _full(model)  # torch's, after training
    got = sg.full_state_dict(model)
    col = sg.full_state_dict(model, transport="collective", bucket_mb=0.001)  # tiny buckets
    bf16 = sg.full_state_dict(model, dtype=torch.bfloat16)
    if rank == 0:
        problems += _same(got, ref, "after training")
        problems += _same(col, ref, "collective, chunked buckets")
        cast = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in ref.items()}
        problems += _same(bf16, cast, "bf16 cast")

    # The stream: every rank receives every tensor (views valid until the next one).
    with sg.Gatherer(model, rank0_only=False, bucket_mb=0.002) as g:
        streamed = {k: t.clone() for k, t in g.iter_full_tensors()}
        again = g.full_state_dict()
    if rank == 0:
        problems += _same(streamed, ref, "stream")
        problems += _same(again, ref, "Gatherer.full_state_dict")

    # Save: one file and the HF layout; async, with a step right after the call.
    path = os.path.join(tmp, "m.safetensors")
    sg.save_full_state_dict(model, path)
    hf = os.path.join(tmp, "hf")
    sg.save_full_state_dict(model, hf, max_shard_size=4000)  # several files
    if rank == 0:
        problems += _same(sg.load_file(path), ref, "saved file")
        from safetensors.torch import load_file as st_load

        index = os.path.join(hf, "model.safetensors.index.json")
        import json

        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        merged = {}
        for name in files:
            merged.update(st_load(os.path.join(hf, name)))
        problems += _same(merged, ref, "HF directory")
    before_step = {k: v.clone() for k, v in ref.items()}
    handle = sg.save_full_state_dict(model, os.path.join(tmp, "async.safetensors"), blocking=False)
    train_steps(model, 0, 1, opt, start=2)  # the file holds the values at call time
    handle.wait()
    if rank == 0:
        problems += _same(
            sg.load_file(os.path.join(tmp, "async.safetensors")), before_step, "async save"
        )
    ref = _full(model)
    osd = sg.full_optim_state_dict(model, opt)
    optim_ref = _optim_reference(model, opt)  # collective (full_tensor): every rank
    if rank == 0:
        for key, states in optim_ref.items():
            for name, v in states.items():
                g_ = osd["state"].get(key, {}).get(name)
                if g_ is None or not torch.equal(g_, v):
                    problems.append(f"optimizer state {key}/{name} differs from full_tensor()")

    # Load into a model built the same way from another seed: every local tensor must
    # equal the saved model's, each rank reading only (about) its own bytes.
    sg.save_full_state_dict(model, path)
    sg.save_full_state_dict(model, hf, max_shard_size=4000)
    other, _ = build_nd(kind, seed=1)
    with counting() as c:
        sg.load_full_state_dict(other, path)
    problems += _same(local_tensors(other), local_tensors(model), "load (local tensors)")
    # Exactly its own elements and the buffers every rank holds: nothing of the other
    # ranks' blocks (the file and the model are both fp32).
    own = sum(t.numel() * t.element_size() for t in local_tensors(model).values())
    own += sum(
        b.numel() * b.element_size()
        for m in model.modules()
        for n, b in m._buffers.items()
        if b is not None and n not in m._non_persistent_buffers_set
    )
    if c["bytes_read"] != own:
        problems.append(f"rank {rank} read {c['bytes_read']} tensor bytes, holds {own}")
    other2, _ = build_nd(kind, seed=2)
    sg.load_full_state_dict(other2, hf)
    problems += _same(local_tensors(other2), local_tensors(model), "load HF directory")
    other3, _ = build_nd(kind, seed=3)
    sg.load_full_state_dict(other3, sg.full_state_dict(model))  # {} on ranks but 0
    problems += _same(local_tensors(other3), local_tensors(model), "load from rank 0's dict")

    # Optimizer state into a fresh optimizer; then a checkpoint and an exact resume.
    opt_other = make_optimizer(other)
    sg.load_full_optim_state_dict(other, opt_other, osd if rank == 0 else {})
    problems += _same(_local_optim(other, opt_other), _local_optim(model, opt), "optimizer load")
    ckpt = os.path.join(tmp, "ckpt")
    sg.save_checkpoint(ckpt, model, opt, extra={"step": 3})
    resumed, _ = build_nd(kind, seed=4)
    opt_resumed = make_optimizer(resumed)
    extra = sg.load_checkpoint(ckpt, resumed, opt_resumed, timeout=datetime.timedelta(seconds=60))
    problems += [] if extra == {"step": 3} else [f"extra {extra}"]
    a = train_steps(model, 0, 1, opt, start=3)
    b = train_steps(resumed, 0, 1, opt_resumed, start=3)
    problems += _same(local_tensors(resumed), local_tensors(model), "resumed step")
    if a != b:
        problems.append(f"resumed loss {b} != {a}")
    return {"problems": problems}


ND_CASES = ["tp", "fsdp2-tp", "fsdp2-tp-bf16", "replicate-tp", "fsdp2-shard1", "fsdp2-ep"]


@pytest.mark.parametrize("kind", ND_CASES)
def test_every_verb_on_nd_layouts(kind: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The failures of issue 26 (each layout refused by every verb) pass here."""
    world = ND_KINDS[kind][0]
    results = dist_harness.run(
        "tests.test_nd:nd_case", world, kind=kind, tmp=str(tmp_path), timeout=400
    )
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)


def hsdp_tp_case(rank: int, world: int, tmp: str) -> dict:  # type: ignore[type-arg]
    """HSDP over TP on a 3-D mesh (replicas x dp x tp): one replica gathers and writes;
    every rank loads its own block back."""
    model, plain = build_nd("hsdp-tp", seed=0)
    problems: list[str] = []
    got = sg.full_state_dict(model)
    if rank == 0:
        problems += _same(got, plain.state_dict(), "gather")
    opt = make_optimizer(model)
    train_steps(model, 0, 1, opt)
    ref = _full(model)
    path = os.path.join(tmp, "m.safetensors")
    sg.save_full_state_dict(model, path)
    if rank == 0:
        problems += _same(sg.load_file(path), ref, "save")
    other, _ = build_nd("hsdp-tp", seed=1)
    sg.load_full_state_dict(other, path)
    problems += _same(local_tensors(other), local_tensors(model), "load")
    return {"problems": problems}


def test_hsdp_over_tp_on_a_3d_mesh(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = dist_harness.run("tests.test_nd:hsdp_tp_case", 8, tmp=str(tmp_path), timeout=400)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)


def across_layouts(rank: int, world: int, tmp: str) -> dict:  # type: ignore[type-arg]
    """A checkpoint of a 2-D (FSDP2 x TP) run resumes exactly as 1-D FSDP2, and that one
    as a plain model (one process), and back: the same model and optimizer state."""
    problems: list[str] = []
    model, _ = build_nd("fsdp2-tp", seed=0)
    opt = make_optimizer(model)
    train_steps(model, 0, 2, opt)
    ckpt2d = os.path.join(tmp, "ckpt-2d")
    sg.save_checkpoint(ckpt2d, model, opt)
    ref = sg.full_state_dict(model, rank0_only=False)
    ref_osd = sg.full_optim_state_dict(model, opt, rank0_only=False)
    one_d, _ = build_nd("fsdp2", seed=5)
    opt1 = make_optimizer(one_d)
    sg.load_checkpoint(ckpt2d, one_d, opt1)
    problems += _same(sg.full_state_dict(one_d, rank0_only=False), ref, "2-D -> 1-D model")
    osd1 = sg.full_optim_state_dict(one_d, opt1, rank0_only=False)
    for key, states in ref_osd["state"].items():
        for name, v in states.items():
            if not torch.equal(osd1["state"][key][name], v):
                problems.append(f"2-D -> 1-D optimizer {key}/{name}")
    ckpt1d = os.path.join(tmp, "ckpt-1d")
    sg.save_checkpoint(ckpt1d, one_d, opt1)
    # A plain model on every rank (each holds it whole; still one call on every rank).
    plain_model, _ = build_nd("plain", seed=6)
    popt = make_optimizer(plain_model)
    sg.load_checkpoint(ckpt1d, plain_model, popt)
    problems += _same(plain_model.state_dict(), ref, "1-D -> plain")
    a_plain = train_steps(plain_model, 0, 1, popt, start=2)
    back, _ = build_nd("fsdp2-tp", seed=7)
    opt_back = make_optimizer(back)
    sg.load_checkpoint(ckpt1d, back, opt_back)
    problems += _same(local_tensors(back), local_tensors(model), "1-D -> 2-D")
    a = train_steps(model, 0, 1, opt, start=2)
    b = train_steps(back, 0, 1, opt_back, start=2)
    problems += [] if a == b else [f"loss after the round trip {b} != {a}"]
    # The plain model's step matches the sharded one's up to reduction order only.
    if abs(a_plain - a) > 1e-5 * max(1.0, abs(a)):
        problems.append(f"plain model's next loss {a_plain} vs the sharded model's {a}")
    problems += _same(local_tensors(back), local_tensors(model), "a step after the round trip")
    return {"problems": problems}


def test_checkpoints_cross_layouts_2d_1d_plain_and_back(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = dist_harness.run("tests.test_nd:across_layouts", 4, tmp=str(tmp_path), timeout=400)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)


def partial_dtensor(rank: int, world: int) -> dict:  # type: ignore[type-arg]
    """What torch cannot express as values stays a clear error naming key and placement."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (world,))
    m = nn.Linear(4, 4)
    m.weight = nn.Parameter(DTensor.from_local(torch.ones(4, 4), mesh, [Partial()]))
    try:
        sg.full_state_dict(m)
    except sg.UnsupportedModelError as exc:
        return {"raised": str(exc)}
    return {"raised": None}


def test_a_partial_placement_is_a_clear_error() -> None:
    for r in dist_harness.run("tests.test_nd:partial_dtensor", 2):
        assert r["raised"] and "'weight'" in r["raised"] and "Partial" in r["raised"], r
