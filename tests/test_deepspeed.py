"""DeepSpeed ZeRO-1/2/3 checkpoints, written by the real library (2 gloo ranks on the
CPU), consolidated and loaded without unpickling: bit-exact against the values the
engine itself reports (``safe_get_full_fp32_param`` and friends), frozen parameters,
buffers and ties included; hostile and damaged files refused before anything is
written."""

from __future__ import annotations

import os
import pickle
import shutil
import zipfile

import pytest
import torch

import shardgather as sg
from shardgather.__main__ import main
from shardgather.errors import CheckpointError

from . import dist_harness
from .compare import diff_state_dicts

STAGES = (1, 2, 3)


class DSModel(torch.nn.Module):
    """Tied embedding/head, a frozen layer, an odd-sized layer (uneven ZeRO-3 slices)
    and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.frozen = torch.nn.Linear(16, 16)
        self.l1 = torch.nn.Linear(16, 33)
        self.l2 = torch.nn.Linear(33, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("pos", torch.arange(7.0))
        for p in self.frozen.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.frozen(self.emb(x)) + self.pos[: x.shape[1], None]
        return self.head(self.l2(torch.relu(self.l1(h))))


def _deepspeed():  # type: ignore[no-untyped-def]
    # The CPU accelerator, and no shared-memory comm op (it would compile for ~40 s):
    # DeepSpeed reuses the gloo group the harness made.
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def _trained_engine(rank: int, world: int, zero: dict, steps: int):  # type: ignore[no-untyped-def]
    """A DeepSpeed engine (``zero_optimization``: ``zero``) of DSModel after ``steps``
    AdamW steps on this rank's own batches."""
    deepspeed = _deepspeed()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.manual_seed(0)
    model = DSModel()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randint(0, 50, (2, 7), generator=gen)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    return engine


def _train(rank: int, world: int, stage: int, out: str, steps: int = 3) -> dict:
    engine = _trained_engine(rank, world, {"stage": stage}, steps)
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    engine.save_checkpoint(out)
    # The oracle: what the engine reports as each full value (collectives at ZeRO-3).
    want: dict[str, dict[str, torch.Tensor]] = {"param": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            want["param"][name] = safe_get_full_fp32_param(p).clone()
            for s in ("exp_avg", "exp_avg_sq"):
                want[s][name] = safe_get_full_optimizer_state(p, s).clone()
    if stage == 3:
        full = engine._zero3_consolidated_16bit_state_dict()  # rank 0 only
    else:
        full = engine.module.state_dict()
    return {k: v.clone() for k, v in full.items()} | {"__oracle__": want} if rank == 0 else {}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[int, tuple[str, dict]]:  # type: ignore[no-untyped-def]
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("deepspeed")
    out = {}
    for stage in STAGES:
        d = str(root / f"zero{stage}")
        res = dist_harness.run("tests.test_deepspeed:_train", 2, timeout=240, stage=stage, out=d)
        out[stage] = (d, res[0])
    return out


def _expected(result: dict) -> dict[str, torch.Tensor]:
    """The full model state as a plain model reports it: trainable values from the
    engine's fp32 masters, the rest (frozen, buffer) from its own full state dict."""
    oracle = result["__oracle__"]["param"]
    model = DSModel()
    out = {}
    for k in model.state_dict():
        src = "emb.weight" if k == "head.weight" else k
        out[k] = oracle[src] if src in oracle else result[src]
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_consolidate_is_bit_exact_with_frozen_tied_and_buffers(
    checkpoints, stage, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    d, result = checkpoints[stage]
    out = tmp_path / "model.safetensors"
    # Regression: `inspect` failed on what `consolidate` takes.
    assert main(["inspect", d]) == 0
    assert main(["consolidate", d, str(out), "--no-progress"]) == 0  # the parent, via latest
    got = sg.load_file(out)
    want = _expected(result)
    assert not diff_state_dicts(got, want, order=False)
    assert got["head.weight"].data_ptr() == got["emb.weight"].data_ptr()  # stored once
    # A plain model takes the file strictly; a bf16 export is the cast of the same values.
    plain = DSModel()
    plain.load_state_dict(got)
    bf16 = tmp_path / "bf16"
    args = ["consolidate", _step_dir(d), str(bf16), "--dtype", "bf16"]
    assert main([*args, "--max-shard-size", "3KB", "--workers", "3", "--no-progress"]) == 0
    assert len([n for n in os.listdir(bf16) if n.endswith(".safetensors")]) > 1
    half = DSModel().bfloat16()
    sg.load_full_state_dict(half, bf16)  # the HF directory, through its index
    want16 = {k: v.bfloat16() for k, v in want.items()}
    assert not diff_state_dicts(half.state_dict(), want16, order=False)


@pytest.mark.parametrize("stage", STAGES)
def test_agrees_with_zero_to_fp32_and_keeps_what_it_drops(checkpoints, stage, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """DeepSpeed's own converter (trusted here: it unpickles the files) agrees on every
    tensor it writes; at ZeRO-1 it drops the frozen parameters, which we keep."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    d, result = checkpoints[stage]
    theirs = get_fp32_state_dict_from_zero_checkpoint(d)
    ours = sg.load_file(_consolidated(d, tmp_path))
    assert set(theirs) <= set(ours)
    assert not diff_state_dicts({k: ours[k] for k in theirs}, theirs, order=False)
    dropped = set(ours) - set(theirs)
    assert dropped == ({"frozen.weight", "frozen.bias"} if stage == 1 else set())


def _consolidated(d: str, tmp_path) -> str:  # type: ignore[no-untyped-def]
    out = str(tmp_path / "c.safetensors")
    assert main(["consolidate", d, out, "--no-progress"]) == 0
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_load_full_state_dict_from_the_directory(checkpoints, stage) -> None:  # type: ignore[no-untyped-def]
    d, result = checkpoints[stage]
    model = DSModel()
    res = sg.load_full_state_dict(model, d)
    assert res.missing_keys == [] and res.unexpected_keys == []
    assert not diff_state_dicts(model.state_dict(), _expected(result), order=False)


def _load_fsdp2(rank: int, world: int, d: str) -> dict:
    from torch.distributed.fsdp import fully_shard

    from shardgather import _dist

    torch.manual_seed(1)
    model = DSModel()
    for m in (model.l1, model.l2):
        fully_shard(m)
    fully_shard(model)
    before = _dist.STATS["bytes_read"]
    sg.load_full_state_dict(model, d)
    read = _dist.STATS["bytes_read"] - before
    return {"sd": sg.full_state_dict(model), "read": read}


def test_fsdp2_ranks_read_only_their_own_bytes(checkpoints) -> None:  # type: ignore[no-untyped-def]
    d, result = checkpoints[3]
    res = dist_harness.run("tests.test_deepspeed:_load_fsdp2", 2, d=d)
    want = _expected(result)
    assert not diff_state_dicts(res[0]["sd"], want, order=False)
    total = sum(v.nbytes for k, v in want.items() if k != "head.weight")
    assert all(r["read"] < 0.8 * total for r in res), [r["read"] for r in res]


# ------------------------------------------------------------------ bad input


def _copy(d: str, tmp_path) -> str:  # type: ignore[no-untyped-def]
    dst = str(tmp_path / "copy")
    shutil.copytree(d, dst)
    return dst


def _step_dir(d: str) -> str:
    with open(os.path.join(d, "latest")) as f:
        return os.path.join(d, f.read().strip())


class _RunsCode:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {os.environ['SG_PWNED']}",))


def _refused(d: str, tmp_path, match: str) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out.safetensors"
    with pytest.raises(CheckpointError, match=match):
        from shardgather.io.deepspeed_format import read_zero_checkpoint

        read_zero_checkpoint(d)
    assert main(["consolidate", d, str(out), "--no-progress"]) == 2
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if n.startswith(".out")]
    with pytest.raises(CheckpointError, match=match):
        sg.load_full_state_dict(DSModel(), d)


@pytest.mark.parametrize("which", ["optim", "model"])
def test_a_pickle_that_runs_code_is_refused(checkpoints, tmp_path, monkeypatch, which) -> None:  # type: ignore[no-untyped-def]
    d = _copy(checkpoints[3][0], tmp_path)
    marker = tmp_path / "pwned"
    monkeypatch.setenv("SG_PWNED", str(marker))
    path = os.path.join(_step_dir(d), f"zero_pp_rank_1_mp_rank_00_{which}_states.pt")
    obj = torch.load(path, weights_only=False)
    obj["ds_version"] = _RunsCode()
    torch.save(obj, path)
    _refused(d, tmp_path, "refusing to unpickle posix.system")
    assert not marker.exists()


def test_a_truncated_file_is_refused(checkpoints, tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = _copy(checkpoints[2][0], tmp_path)
    path = os.path.join(_step_dir(d), "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    _refused(d, tmp_path, "truncated or damaged")


def test_a_missing_rank_is_refused(checkpoints, tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = _copy(checkpoints[3][0], tmp_path)
    os.remove(os.path.join(_step_dir(d), "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    _refused(d, tmp_path, "partitioned over 2 ranks but holds 1")


@pytest.mark.parametrize("stage", [2, 3])
def test_shapes_that_do_not_add_up_are_refused(checkpoints, tmp_path, stage) -> None:  # type: ignore[no-untyped-def]
    d = _copy(checkpoints[stage][0], tmp_path)
    name = (
        "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    )
    path = os.path.join(_step_dir(d), name)
    obj = torch.load(path, weights_only=False)
    obj["param_shapes"][0]["l1.weight"] = torch.Size([40, 16])
    torch.save(obj, path)
    _refused(d, tmp_path, "do not add up")


def test_latest_naming_outside_is_refused(checkpoints, tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = _copy(checkpoints[1][0], tmp_path)
    with open(os.path.join(d, "latest"), "w") as f:
        f.write("../../etc")
    _refused(d, tmp_path, "not a directory beside it")


def test_a_compressed_record_is_refused(checkpoints, tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = _copy(checkpoints[1][0], tmp_path)
    path = os.path.join(_step_dir(d), "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with zipfile.ZipFile(path) as z:
        members = [(i, z.read(i.filename)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for info, data in members:
            z.writestr(info.filename, data)
    _refused(d, tmp_path, "missing or compressed")


def test_pickle_module_is_not_what_reads(checkpoints, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Consolidation never reaches torch.load or pickle.load (only the restricted
    unpickler runs)."""

    def boom(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("unpickled with full powers")

    monkeypatch.setattr(torch, "load", boom)
    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "loads", boom)
    assert main(["consolidate", checkpoints[3][0], str(tmp_path / "m.safetensors")]) == 0


# ------------------------------------------------------------------ optimizer state


def _check_resumed(model, opt, result) -> None:  # type: ignore[no-untyped-def]
    oracle = result["__oracle__"]
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in opt.state} == set(oracle["param"])
    for p, state in opt.state.items():
        n = names[id(p)]
        assert float(state["step"]) == 3.0
        for s in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[s], oracle[s][n]), (n, s)


@pytest.mark.parametrize("stage", STAGES)
def test_checkpoint_carries_the_adam_moments_by_name(checkpoints, stage, tmp_path) -> None:  # type: ignore[no-untyped-def]
    d, result = checkpoints[stage]
    out = tmp_path / "ckpt"
    assert main(["consolidate", d, str(out), "--checkpoint", "--no-progress"]) == 0
    model = DSModel()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sg.load_checkpoint(out, model, opt)
    assert not diff_state_dicts(model.state_dict(), _expected(result), order=False)
    _check_resumed(model, opt, result)
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["weight_decay"] == 0.01


def _resume_fsdp2(rank: int, world: int, path: str) -> dict:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1)
    model = DSModel()
    fully_shard(model.l1)
    fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sg.load_checkpoint(path, model, opt)
    return {"sd": sg.full_state_dict(model), "osd": sg.full_optim_state_dict(model, opt)}


def test_an_fsdp2_run_resumes_from_the_converted_checkpoint(checkpoints, tmp_path) -> None:  # type: ignore[no-untyped-def]
    d, result = checkpoints[3]
    out = str(tmp_path / "ckpt")
    sg.checkpoint_from_zero(d, out)
    res = dist_harness.run("tests.test_deepspeed:_resume_fsdp2", 2, path=out)
    assert not diff_state_dicts(res[0]["sd"], _expected(result), order=False)
    osd = res[0]["osd"]
    oracle = result["__oracle__"]
    assert set(osd["state"]) == set(oracle["param"])
    for n, state in osd["state"].items():
        for s in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[s], oracle[s][n]), (n, s)


# ------------------------------------------------------------------ online (a live engine)


def _online(rank: int, world: int, out: str) -> dict:
    from shardgather import _dist

    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    engine = _trained_engine(rank, world, zero, steps=2)
    assert all(p.numel() == 0 for p in engine.module.parameters())  # partitioned
    got = sg.full_state_dict(engine)
    gatherer = sg.Gatherer(engine, rank0_only=False)  # a weight stream, every rank
    streamed = {k: v.clone() for k, v in gatherer.iter_full_tensors()}
    before = dict(_dist.STATS)
    path = os.path.join(out, "online.safetensors")
    sg.save_full_state_dict(engine, path)
    moved = {k: _dist.STATS[k] - before[k] for k in ("bytes_received", "bytes_sent", "gathers")}
    try:
        sg.load_full_state_dict(engine, path)
        refused = ""
    except sg.UnsupportedModelError as exc:
        refused = str(exc)
    want = engine._zero3_consolidated_16bit_state_dict()  # DeepSpeed's own, rank 0
    return {
        "got": got,
        "streamed": streamed,
        "want": dict(want or {}),
        "moved": moved,
        "refused": refused,
    }


def test_a_live_zero3_engine_exports_without_gathering_onto_rank0(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("deepspeed")
    res = dist_harness.run("tests.test_deepspeed:_online", 2, timeout=240, out=str(tmp_path))
    want = res[0]["want"]
    assert not diff_state_dicts(res[0]["got"], want, order=False)
    assert res[1]["got"] == {}
    no_alias = {k: v for k, v in want.items() if k != "head.weight"}  # tied: yielded once
    assert all(not diff_state_dicts(r["streamed"], no_alias, order=False) for r in res)
    file = sg.load_file(tmp_path / "online.safetensors")
    assert not diff_state_dicts(file, want, order=False)
    assert file["head.weight"].data_ptr() == file["emb.weight"].data_ptr()
    # Each rank wrote its own slices (node-local): nothing travelled, no collective.
    assert all(set(r["moved"].values()) == {0} for r in res), [r["moved"] for r in res]
    assert all("ZeRO-3 partition" in r["refused"] for r in res)
