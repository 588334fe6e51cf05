"""Lightning 2.6, for real (Fabric and the Trainer, ModelParallelStrategy = FSDP2 on
the CPU with gloo, 2 processes): keys are the plain model's whatever Lightning wraps
around it, and shardgather's strategies save consolidated checkpoints that a plain
``nn.Module`` loads and that resume bit-exactly."""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

import pytest
import torch

import shardgather as sg

from . import dist_harness
from .compare import diff_state_dicts
from .models import TinyLM, batch

pytest.importorskip("lightning")
pytestmark = pytest.mark.distributed


def _lightning_env(rank: int, world: int) -> None:
    # The harness made the processes and the process group: Lightning joins them.
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",
    )


def _fully_shard(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fabric(world: int, shardgather_strategy: bool):  # type: ignore[no-untyped-def]
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy

    from shardgather.integrations.lightning import FabricModelParallelStrategy

    cls = FabricModelParallelStrategy if shardgather_strategy else ModelParallelStrategy
    strategy = cls(
        parallelize_fn=lambda m, mesh: _fully_shard(m, mesh["data_parallel"]),
        data_parallel_size=world,
        tensor_parallel_size=1,
    )
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    return fabric


def _fabric_model(fabric, seed: int):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    plain = TinyLM()
    model = fabric.setup_module(copy.deepcopy(plain))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return plain, model, opt


def _fabric_steps(fabric, model, opt, rank: int, start: int, n: int) -> None:  # type: ignore[no-untyped-def]
    for s in range(start, start + n):
        opt.zero_grad()
        fabric.backward(model(batch(rank, s)).float().pow(2).mean())
        opt.step()


def fabric_keys_worker(rank: int, world: int, path: str) -> dict:  # type: ignore[type-arg]
    """Lightning's own strategy: every shardgather verb on the _FabricModule."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    _lightning_env(rank, world)
    fabric = _fabric(world, shardgather_strategy=False)
    plain, model, opt = _fabric_model(fabric, seed=0)
    problems: list[str] = []
    sd = sg.full_state_dict(model)
    if rank == 0:
        problems += ["before training: " + p for p in diff_state_dicts(sd, plain.state_dict())]
    _fabric_steps(fabric, model, opt, rank, 0, 2)
    sd = sg.full_state_dict(model)
    ref = get_model_state_dict(
        model.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    osd = sg.full_optim_state_dict(model, opt)
    file = os.path.join(path, "model.safetensors")
    sg.save_full_state_dict(model, file)
    if rank == 0:
        problems += ["vs torch: " + p for p in diff_state_dicts(sd, ref)]
        fresh = TinyLM()
        fresh.load_state_dict(sg.load_file(file), strict=True)  # a plain module loads it
        problems += ["file: " + p for p in diff_state_dicts(fresh.state_dict(), sd)]
        names = {k for k, _ in plain.named_parameters()}
        if set(osd["state"]) != names:
            problems.append(f"optimizer keys {sorted(osd['state'])[:4]}...")
    # A plain checkpoint loads into the Fabric module.
    torch.manual_seed(9)
    other = TinyLM()
    sg.save_full_state_dict(other, os.path.join(path, "plain.safetensors"))  # every rank
    sg.load_full_state_dict(model, os.path.join(path, "plain.safetensors"))
    got = sg.full_state_dict(model)
    if rank == 0:
        problems += ["plain into fabric: " + p for p in diff_state_dicts(got, other.state_dict())]
    return {"problems": problems, "keys": len(sd)}


def test_fabric_module_keys_are_the_plain_models(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = dist_harness.run("tests.test_lightning:fabric_keys_worker", 2, path=str(tmp_path))
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert results[0]["keys"] == len(TinyLM().state_dict())


def fabric_resume_worker(rank: int, world: int, ckpt: str, phase: str, n: int) -> dict:  # type: ignore[type-arg]
    """phase "save": train n steps, fabric.save, train n more (the uninterrupted run);
    "resume": a fresh model (other seed) fabric.load's and trains the same n steps."""
    _lightning_env(rank, world)
    fabric = _fabric(world, shardgather_strategy=True)
    _, model, opt = _fabric_model(fabric, seed=0 if phase == "save" else 1)
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0, "note": None}
    if phase == "save":
        _fabric_steps(fabric, model, opt, rank, 0, n)
        fabric.save(ckpt, {"model": model, "optimizer": opt, "step": n, "note": "hi"})
        saved = sg.full_state_dict(model)
    else:
        remainder = fabric.load(ckpt, state)
        saved = sg.full_state_dict(model)
        if state["step"] != n or state["note"] != "hi" or remainder:
            return {"problems": [f"state after load {state['step']}, {state['note']}"]}
    if world > 1:
        _fabric_steps(fabric, model, opt, rank, n, n)
    return {"problems": [], "saved": saved, "final": sg.full_state_dict(model)}


def test_fabric_strategy_saves_consolidated_and_resumes_bit_exactly(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ckpt = str(tmp_path / "ckpt")
    kw = {"ckpt": ckpt, "n": 2}
    a = dist_harness.run("tests.test_lightning:fabric_resume_worker", 2, phase="save", **kw)[0]
    assert sorted(os.listdir(ckpt)) == [
        "extra.pt",
        "model.safetensors",
        "optim.json",
        "optim.safetensors",
    ]
    plain = TinyLM()
    plain.load_state_dict(sg.load_file(os.path.join(ckpt, "model.safetensors")), strict=True)
    assert not diff_state_dicts(plain.state_dict(), a["saved"])
    b = dist_harness.run("tests.test_lightning:fabric_resume_worker", 2, phase="resume", **kw)
    assert not b[0]["problems"], b[0]["problems"]
    assert not diff_state_dicts(b[0]["saved"], a["saved"])
    assert not diff_state_dicts(b[0]["final"], a["final"])  # continued bit-exactly
    # Another world size loads the same checkpoint.
    c = dist_harness.run("tests.test_lightning:fabric_resume_worker", 1, phase="resume", **kw)
    assert not c[0]["problems"] and not diff_state_dicts(c[0]["saved"], a["saved"])


# ------------------------------------------------------------------------------- Trainer


def _lit_module(fail_at: int | None = None, failing_rank: int | None = None):  # type: ignore[no-untyped-def]
    """``fail_at``: the training step raises at that global step (on ``failing_rank``,
    default every rank)."""
    import lightning as L

    class LitLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lm = TinyLM()
            self.save_hyperparameters({"d": 12})  # an AttributeDict in the checkpoint

        def configure_model(self) -> None:
            _fully_shard(self.lm, self.device_mesh["data_parallel"])

        def training_step(self, tokens: torch.Tensor, _: int) -> torch.Tensor:
            if self.global_step == fail_at and failing_rank in (None, self.global_rank):
                raise RuntimeError("a planned failure")
            return self.lm(tokens).float().pow(2).mean()

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self):  # type: ignore[no-untyped-def]
            # Every sample alike: which batch a resumed epoch starts with is Lightning's
            # data-loader business (a plain DataLoader cannot resume mid-epoch); the
            # model, optimizer, LR schedule and loop counters are the checkpoint's.
            data = batch(0, 0)[:1].repeat(8, 1)
            return torch.utils.data.DataLoader(data, batch_size=2, shuffle=False)

    return LitLM()


def _trainer(world: int, max_steps: int, **options: Any):  # type: ignore[no-untyped-def]
    import lightning as L

    from shardgather.integrations.lightning import ModelParallelStrategy

    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": world,
        "strategy": ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
        "max_steps": max_steps,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return L.Trainer(**{**kwargs, **options})


def trainer_worker(rank: int, world: int, ckpt: str) -> dict:  # type: ignore[type-arg]
    """Uninterrupted 4 steps; 2 steps + save; a fresh Trainer resumes to 4 steps."""
    _lightning_env(rank, world)
    whole = _trainer(world, 4)
    module = _lit_module()
    whole.fit(module)
    want = sg.full_state_dict(whole.strategy.model)

    first = _trainer(world, 2)
    module = _lit_module()
    first.fit(module)
    first.save_checkpoint(ckpt)
    saved = sg.full_state_dict(first.strategy.model)

    second = _trainer(world, 4)
    module = _lit_module()
    second.fit(module, ckpt_path=ckpt)
    got = sg.full_state_dict(second.strategy.model)
    problems: list[str] = []
    if rank == 0:
        problems += ["resumed: " + p for p in diff_state_dicts(got, want)]
        if second.global_step != 4:
            problems.append(f"global_step {second.global_step}")
    return {"problems": problems, "saved": saved}


def test_trainer_strategy_saves_consolidated_and_resumes_bit_exactly(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ckpt = str(tmp_path / "last.ckpt")
    results = dist_harness.run("tests.test_lightning:trainer_worker", 2, ckpt=ckpt)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    # The consolidated weights load into the plain LightningModule's network.
    plain = TinyLM()
    sd = sg.load_file(os.path.join(ckpt, "model.safetensors"))
    plain.load_state_dict({k.removeprefix("lm."): v for k, v in sd.items()}, strict=True)
    assert not diff_state_dicts(
        {f"lm.{k}": v for k, v in plain.state_dict().items()}, results[0]["saved"]
    )
    extra = torch.load(os.path.join(ckpt, "extra.pt"), weights_only=True)
    assert extra["global_step"] == 2 and extra["hyper_parameters"] == {"d": 12}


def _save_every(n: int, root: str):  # type: ignore[no-untyped-def]
    """The README's recipe: a callback that saves in the background every n steps."""
    import lightning as L

    class SaveEvery(L.Callback):
        def __init__(self) -> None:
            self.handle = None
            self.blocked: list[float] = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            if trainer.global_step % n == 0:
                import time

                t = time.perf_counter()
                self.handle = sg.save_checkpoint(
                    os.path.join(root, str(trainer.global_step)),
                    module,
                    trainer.optimizers[0],
                    extra={"step": trainer.global_step},
                    blocking=False,
                )
                self.blocked.append(time.perf_counter() - t)

        def on_train_end(self, trainer, module):  # type: ignore[no-untyped-def]
            if self.handle is not None:
                self.handle.wait()

    return SaveEvery()


def trainer_async_worker(rank: int, world: int, root: str) -> dict:  # type: ignore[type-arg]
    """Saves every 2 steps in the background while the Trainer trains on: each
    checkpoint holds the state of its step, as an uninterrupted run reaches it."""
    _lightning_env(rank, world)
    want = {}
    for steps in (2, 4):
        run = _trainer(world, steps)
        run.fit(_lit_module())
        want[steps] = sg.full_state_dict(run.strategy.model)
    trainer = _trainer(world, 4)
    saver = _save_every(2, root)
    trainer.callbacks.append(saver)
    trainer.fit(_lit_module())
    problems: list[str] = []
    for steps in (2, 4):
        if rank == 0:
            sd = sg.load_file(os.path.join(root, str(steps), "model.safetensors"))
            problems += [
                f"step {steps}: " + p for p in diff_state_dicts(sd, want[steps], order=False)
            ]
            got_extra = torch.load(os.path.join(root, str(steps), "extra.pt"), weights_only=True)
            if got_extra != {"step": steps}:
                problems.append(f"extra {got_extra}")

    # The strategy with Lightning's own switch (AsyncCheckpointIO) and a ModelCheckpoint
    # keeping the last one: step 2's checkpoint is removed only once step 4's is published.
    import lightning as L
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    dirpath = os.path.join(root, "by-strategy")
    seen: dict[str, list[str]] = {}

    class Look(L.Callback):
        def on_train_end(self, trainer, module):  # type: ignore[no-untyped-def]
            seen["at train end"] = sorted(os.listdir(dirpath))

    keep_last = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=dirpath, every_n_train_steps=2, save_top_k=1
    )
    trainer = _trainer(
        world,
        4,
        enable_checkpointing=True,
        callbacks=[keep_last, Look()],
        plugins=[AsyncCheckpointIO()],
    )
    trainer.fit(_lit_module())
    seen["after fit"] = sorted(os.listdir(dirpath))
    if rank == 0:
        # Step 4's save is still pending at train end (finished by the teardown), and
        # step 2's, published by it, is still there: never no checkpoint at all.
        if "epoch=0-step=2.ckpt" not in seen["at train end"] or any(
            "step=4" in n and not n.startswith(".") for n in seen["at train end"]
        ):
            problems.append(f"at train end: {seen['at train end']}")
        last = [n for n in seen["after fit"] if "step=4" in n]  # epoch=1: the epoch ended
        if len(seen["after fit"]) != 1 or len(last) != 1:
            problems.append(f"after fit: {seen['after fit']}")
            return {"problems": problems, "blocked": saver.blocked}
        sd = sg.load_file(os.path.join(dirpath, last[0], "model.safetensors"))
        problems += ["strategy, step 4: " + p for p in diff_state_dicts(sd, want[4], order=False)]

    # Training fails on every rank right after a background save: the save still lands
    # (the ranks settle it in on_exception), and nothing else is left.
    crashed = os.path.join(root, "crashed")
    keep_all = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=crashed, every_n_train_steps=2, save_top_k=-1
    )
    trainer = _trainer(
        world, 6, enable_checkpointing=True, callbacks=[keep_all], plugins=[AsyncCheckpointIO()]
    )
    try:
        trainer.fit(_lit_module(fail_at=2))
        problems.append("the planned failure did not raise")
    except RuntimeError as exc:
        if "a planned failure" not in str(exc):
            problems.append(f"raised {exc!r}")
    if rank == 0:
        if sorted(os.listdir(crashed)) != ["epoch=0-step=2.ckpt"]:
            problems.append(f"after the failure: {sorted(os.listdir(crashed))}")
        else:
            sd = sg.load_file(os.path.join(crashed, "epoch=0-step=2.ckpt", "model.safetensors"))
            problems += [
                "crashed, step 2: " + p for p in diff_state_dicts(sd, want[2], order=False)
            ]
    return {"problems": problems, "blocked": saver.blocked}


def trainer_fails_alone_worker(rank: int, world: int, root: str) -> dict:  # type: ignore[type-arg]
    """Rank 1 alone fails right after a background save: it must not wait the
    checkpoint timeout for a peer that will not settle the save (rank 0 is in its next
    training collective, and fails when rank 1's process leaves)."""
    import datetime
    import time

    import lightning as L
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    _lightning_env(rank, world)
    trainer = _trainer(
        world,
        6,
        enable_checkpointing=True,
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=2)],
        plugins=[AsyncCheckpointIO()],
    )
    trainer.strategy.checkpoint_timeout = datetime.timedelta(seconds=600)  # never reached
    trainer.strategy.settle_on_exception_timeout = datetime.timedelta(seconds=3)
    t = time.monotonic()
    try:
        trainer.fit(_lit_module(fail_at=2, failing_rank=1))
        error = None
    except BaseException as exc:
        error = f"{type(exc).__name__}: {str(exc)[:200]}"
    return {"error": error, "seconds": time.monotonic() - t}


def test_a_rank_failing_alone_does_not_wait_for_the_save(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = dist_harness.run(
        "tests.test_lightning:trainer_fails_alone_worker", 2, root=str(tmp_path), timeout=120
    )
    assert "a planned failure" in results[1]["error"]
    assert results[0]["error"] is not None
    # Nothing published (the ranks never agreed), no temporary left under the final name.
    assert not [n for n in os.listdir(tmp_path) if not n.startswith(".")]


def test_trainer_saves_in_the_background_every_n_steps(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = dist_harness.run("tests.test_lightning:trainer_async_worker", 2, root=str(tmp_path))
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert sorted(os.listdir(tmp_path)) == ["2", "4", "by-strategy", "crashed"]
    assert all(len(r["blocked"]) == 2 for r in results)


# ------------------------------------------------------- tensor parallel (issue 26)


def _tp_fully_shard(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """The README's recipe: the user's TP plan on "tensor_parallel", FSDP2 on "data_parallel"."""
    from torch.distributed.tensor.parallel import parallelize_module

    from .builders import tp_plan

    parallelize_module(model, mesh["tensor_parallel"], tp_plan(model))
    return _fully_shard(model, mesh["data_parallel"])


def _tp_steps(fabric, model, opt, rank: int, start: int, n: int) -> None:  # type: ignore[no-untyped-def]
    for s in range(start, start + n):  # the ranks of one TP group see the same batch
        opt.zero_grad()
        fabric.backward(model(batch(rank // 2, s)).float().pow(2).mean())
        opt.step()


def fabric_tp_worker(rank: int, world: int, root: str) -> dict:  # type: ignore[type-arg]
    """dp 2 x tp 2 through shardgather's Fabric strategy: 2 steps, fabric.save, 2 more
    (the uninterrupted run); a model of another seed fabric.load's and does the same 2."""
    import lightning as L
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from shardgather.integrations.lightning import FabricModelParallelStrategy

    _lightning_env(rank, world)
    strategy = FabricModelParallelStrategy(
        parallelize_fn=_tp_fully_shard, data_parallel_size=2, tensor_parallel_size=2
    )
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()

    def setup(seed: int):  # type: ignore[no-untyped-def]
        torch.manual_seed(seed)
        model = fabric.setup_module(TinyLM(tied=False, hidden=36))
        return model, fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))

    model, opt = setup(0)
    placements = {str(p.placements) for p in model.parameters()}
    _tp_steps(fabric, model, opt, rank, 0, 2)
    ckpt = os.path.join(root, "ckpt")
    fabric.save(ckpt, {"model": model, "optimizer": opt, "step": 2})
    with warnings.catch_warnings():  # FSDP2's own state_dict hooks are not "foreign"
        warnings.filterwarnings("error", message=".*state_dict hooks")
        saved = sg.full_state_dict(model)
    ref = get_model_state_dict(  # on the CPU its plain buffers are the live ones: copy
        model.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    ref = {k: v.clone() for k, v in ref.items()}
    _tp_steps(fabric, model, opt, rank, 2, 2)
    want = sg.full_state_dict(model)

    model, opt = setup(1)
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0}
    fabric.load(ckpt, state)
    loaded = sg.full_state_dict(model)
    _tp_steps(fabric, model, opt, rank, 2, 2)
    got = sg.full_state_dict(model)
    problems: list[str] = []
    if rank == 0:
        problems += ["vs torch: " + p for p in diff_state_dicts(saved, ref)]
        problems += ["loaded: " + p for p in diff_state_dicts(loaded, saved)]
        problems += ["resumed: " + p for p in diff_state_dicts(got, want)]
        if state["step"] != 2:
            problems.append(f"step {state['step']}")
    return {"problems": problems, "saved": saved, "placements": sorted(placements)}


def test_fabric_tensor_parallel_saves_consolidated_and_resumes_bit_exactly(tmp_path) -> None:  # type: ignore[no-untyped-def]
    res = dist_harness.run("tests.test_lightning:fabric_tp_worker", 4, root=str(tmp_path))
    problems = [p for r in res for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert "(_StridedShard(dim=0, sf=2), Shard(dim=0))" in res[0]["placements"]
    plain = TinyLM(tied=False, hidden=36)  # the plain network loads the export strictly
    plain.load_state_dict(sg.load_file(str(tmp_path / "ckpt" / "model.safetensors")), strict=True)
    assert not diff_state_dicts(plain.state_dict(), res[0]["saved"])


def _lit_tp_module():  # type: ignore[no-untyped-def]
    import lightning as L

    class LitTP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lm = TinyLM(tied=False, hidden=36)

        def configure_model(self) -> None:
            _tp_fully_shard(self.lm, self.device_mesh)

        def training_step(self, tokens: torch.Tensor, _: int) -> torch.Tensor:
            return self.lm(tokens).float().pow(2).mean()

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self):  # type: ignore[no-untyped-def]
            data = batch(0, 0)[:1].repeat(8, 1)
            return torch.utils.data.DataLoader(data, batch_size=2, shuffle=False)

    return LitTP()


def trainer_tp_worker(rank: int, world: int, ckpt: str) -> dict:  # type: ignore[type-arg]
    """The Trainer at dp 2 x tp 2: uninterrupted 4 steps; 2 + save; resume to 4."""
    from shardgather.integrations.lightning import ModelParallelStrategy

    _lightning_env(rank, world)

    def trainer(steps: int):  # type: ignore[no-untyped-def]
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
        return _trainer(world, steps, strategy=strategy)

    whole = trainer(4)
    whole.fit(_lit_tp_module())
    want = sg.full_state_dict(whole.strategy.model)
    first = trainer(2)
    first.fit(_lit_tp_module())
    first.save_checkpoint(ckpt)
    saved = sg.full_state_dict(first.strategy.model)
    second = trainer(4)
    second.fit(_lit_tp_module(), ckpt_path=ckpt)
    got = sg.full_state_dict(second.strategy.model)
    problems = ["resumed: " + p for p in diff_state_dicts(got, want)] if rank == 0 else []
    return {"problems": problems, "saved": saved}


def test_trainer_tensor_parallel_saves_consolidated_and_resumes_bit_exactly(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ckpt = str(tmp_path / "last.ckpt")
    res = dist_harness.run("tests.test_lightning:trainer_tp_worker", 4, ckpt=ckpt)
    problems = [p for r in res for p in r["problems"]]
    assert not problems, "\n".join(problems)
    plain = TinyLM(tied=False, hidden=36)
    sd = sg.load_file(os.path.join(ckpt, "model.safetensors"))
    plain.load_state_dict({k.removeprefix("lm."): v for k, v in sd.items()}, strict=True)
    assert not diff_state_dicts(
        {f"lm.{k}": v for k, v in plain.state_dict().items()}, res[0]["saved"]
    )


def fabric_default_sizes_worker(rank: int, world: int) -> dict:  # type: ignore[type-arg]
    """The README's Fabric recipe before issue 27: sizes left at "auto" put both
    processes on "tensor_parallel", and a parallelize function sharding over
    "data_parallel" shards nothing. It used to train two unsynchronised copies silently."""
    import lightning as L

    from shardgather.integrations.lightning import FabricModelParallelStrategy

    _lightning_env(rank, world)
    strategy = FabricModelParallelStrategy(lambda m, mesh: _fully_shard(m, mesh["data_parallel"]))
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.setup_module(TinyLM())
    ours = [w for w in caught if "shardgather" in str(w.message)]
    return {"warnings": [str(w.message) for w in ours], "files": [w.filename for w in ours]}


def test_fabric_sizes_that_shard_nothing_are_warned(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for r in dist_harness.run("tests.test_lightning:fabric_default_sizes_worker", 2):
        assert len(r["warnings"]) == 1, r
        msg = r["warnings"][0]
        assert "'tensor_parallel'" in msg and "tensor_parallel_size=1" in msg, msg
        # Regression: it pointed into Lightning's source, not at the user's call.
        assert r["files"] == [__file__], r["files"]
