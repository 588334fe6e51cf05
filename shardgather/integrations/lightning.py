"""Lightning (Trainer and Fabric): checkpoints through shardgather — one consolidated,
unwrapped directory (``model.safetensors`` a plain ``nn.Module`` loads, optimizer state
keyed by the plain names, the rest of Lightning's checkpoint in ``extra.pt``), streamed
from the shards and loaded back with each rank reading only its own bytes.

Switch it on with one argument::

    from shardgather.integrations.lightning import ModelParallelStrategy
    trainer = L.Trainer(strategy=ModelParallelStrategy(), ...)          # Trainer
    fabric = L.Fabric(strategy=FabricModelParallelStrategy(fn), ...)    # Fabric

Why a Strategy and not a ``CheckpointIO`` or a ``Callback``: the strategy is the one
hook that holds the *sharded* model and optimizer at save and at load time.
``CheckpointIO.save_checkpoint`` receives a dict Lightning has already gathered (every
tensor on rank 0, the slow and memory-hungry step this library removes) and
``Callback.on_save_checkpoint`` runs after that gather too; neither can load into the
shards, so every rank would read the whole checkpoint (the CPU OOM of Lightning's
FSDP reports). The classes here override only the checkpoint methods of Lightning's own
strategies, so everything else (setup, precision, launch) stays Lightning's.

Saving in the background: pass Lightning's own switch, ``plugins=[AsyncCheckpointIO()]``.
Each save then blocks training only for each rank's snapshot of its own shard
(``save_checkpoint(blocking=False)``); the save is finished (agreed, published) at the
next save, a load, or the strategy's teardown, and a checkpoint Lightning asks to
remove meanwhile (``ModelCheckpoint(save_top_k=...)``) is removed only once the newer
one is published — a crash in between leaves the older one, never none. When training
raises, the ranks still finish the save if they all get there within
``settle_on_exception_timeout`` (60 s; every rank failing alike: Ctrl+C, a NaN check); a
rank failing alone gives it up after that, rather than holding the failing job for the
checkpoint timeout.

Lightning is imported only when this module is (the core imports no framework).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.fabric.strategies import FSDPStrategy as _FabricFSDPStrategy
from lightning.fabric.strategies import ModelParallelStrategy as _FabricModelParallelStrategy
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.strategies import FSDPStrategy as _TrainerFSDPStrategy
from lightning.pytorch.strategies import ModelParallelStrategy as _TrainerModelParallelStrategy
from torch import nn

from .._engine.snapshot import AsyncSave
from .._options import DEFAULT_TIMEOUT
from ..checkpoint import load_checkpoint, save_checkpoint
from ..errors import CheckpointError, ShardGatherError

__all__ = [
    "FSDPStrategy",
    "FabricFSDPStrategy",
    "FabricModelParallelStrategy",
    "ModelParallelStrategy",
]

# Lightning's own keys for what the directory stores natively.
_MODEL_KEY, _OPTIM_KEY = "state_dict", "optimizer_states"


def _plain(value: Any) -> Any:
    """Lightning's checkpoint metadata with dict subclasses (``AttributeDict``
    hyper-parameters) as plain dicts, so that it loads with ``weights_only=True``."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_plain(v) for v in value)
    return value


def _one_optimizer(optimizers: list[torch.optim.Optimizer]) -> torch.optim.Optimizer | None:
    if len(optimizers) > 1:
        raise ShardGatherError(
            f"shardgather's Lightning strategies save one optimizer, this run has "
            f"{len(optimizers)}; use Lightning's own strategy for several optimizers"
        )
    opt = optimizers[0] if optimizers else None
    return getattr(opt, "_optimizer", opt)  # LightningOptimizer -> the torch optimizer


def _remove(path: str | os.PathLike, is_global_zero: bool) -> None:
    if is_global_zero and os.path.isdir(path):
        shutil.rmtree(path)
    elif is_global_zero and os.path.exists(path):
        os.unlink(path)


class _TrainerCheckpoints:
    """The Trainer's checkpoint methods, for a strategy whose ``model`` is sharded."""

    model: nn.Module | None
    optimizers: list[torch.optim.Optimizer]
    lightning_module: Any
    is_global_zero: bool
    broadcast: Callable[..., Any]
    checkpoint_io: Any
    checkpoint_timeout: datetime.timedelta = DEFAULT_TIMEOUT
    # How long a failing run waits for its peers to finish a background save.
    settle_on_exception_timeout: datetime.timedelta = datetime.timedelta(seconds=60)
    # A background save not yet finished, and the removals waiting for it.
    _pending: AsyncSave | None = None
    _removals: tuple[str, ...] = ()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # Nothing is gathered here: save_checkpoint streams the model from its shards.
        return {}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores it, into the shards

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint already loaded the model, each rank its own bytes

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass

    def _settle(self, timeout: datetime.timedelta | None = None) -> None:
        """Finish the background save (every rank: a bounded agreement), then carry out
        the removals that waited for it. If it failed, the older checkpoints stay."""
        pending, removals = self._pending, self._removals
        self._pending, self._removals = None, ()
        if pending is not None:
            pending.wait(timeout)
        for path in removals:
            _remove(path, self.is_global_zero)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise ShardGatherError("storage_options are not supported by shardgather's strategy")
        assert self.model is not None
        self._settle()
        path = self.broadcast(os.fspath(filepath))
        extra = {k: v for k, v in checkpoint.items() if k not in (_MODEL_KEY, _OPTIM_KEY)}
        # trainer.save_checkpoint(weights_only=True) leaves the optimizer out: so do we.
        opt = _one_optimizer(self.optimizers) if _OPTIM_KEY in checkpoint else None
        background = isinstance(self.checkpoint_io, AsyncCheckpointIO) and self._running()
        handle = save_checkpoint(
            path,
            self.model,
            opt,
            extra=_plain(extra),
            timeout=self.checkpoint_timeout,
            blocking=not background,
        )
        if background:
            self._pending = handle

    def _running(self) -> bool:
        """Whether a fit (validate, test...) is running: a background save is finished
        by the next save, a load or the run's teardown, so outside a run — a
        ``trainer.save_checkpoint`` after ``fit`` — there would be none to finish it
        (the process exiting discards it): such a save is written at once."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        status = getattr(getattr(trainer, "state", None), "status", None)
        return getattr(status, "value", status) == "running"

    def load_checkpoint(
        self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None
    ) -> dict[str, Any]:
        assert self.model is not None
        self._settle()  # it may be the checkpoint being written
        path = self.broadcast(os.fspath(checkpoint_path))
        if not os.path.isdir(path):
            raise CheckpointError(
                f"{path}: not a shardgather checkpoint directory (a checkpoint of Lightning's "
                "own strategies loads with that strategy)"
            )
        strict = getattr(self.lightning_module, "strict_loading", True)
        opt = _one_optimizer(self.optimizers)
        return load_checkpoint(
            path,
            self.model,
            opt,
            strict=strict,
            trust_pickle=weights_only is False,  # Lightning's explicit opt-in
            timeout=self.checkpoint_timeout,
        )

    def remove_checkpoint(self, filepath: str | os.PathLike) -> None:
        if self._pending is not None:  # only once the newer checkpoint is published
            self._removals = (*self._removals, os.fspath(filepath))
        else:
            _remove(filepath, self.is_global_zero)

    def on_exception(self, exception: BaseException) -> None:
        # Training failed. Every rank failing alike (Ctrl+C, a NaN check) still finishes
        # the background save; a rank failing alone does not wait the checkpoint timeout
        # for peers that will never come (a launcher kills the job once it exits).
        with contextlib.suppress(ShardGatherError):  # then the older checkpoints stay
            self._settle(min(self.checkpoint_timeout, self.settle_on_exception_timeout))
        super().on_exception(exception)  # type: ignore[misc]

    def teardown(self) -> None:
        try:
            self._settle()
        finally:
            super().teardown()  # type: ignore[misc]


def _warn_unused_mesh_dims(model: nn.Module, mesh: Any) -> None:
    """Warn (once per dimension) when a dimension of the strategy's mesh larger than 1
    holds no parameter: the ranks along it train unsynchronised full copies and the
    checkpoint is one rank's copy — silently. The classic cause: Lightning's sizes
    default to "auto", which puts every process on "tensor_parallel", while the
    parallelize function shards over "data_parallel" only. Reads each parameter's
    placement metadata only: no data, no collective."""
    from torch.distributed.tensor import DTensor

    names = getattr(mesh, "mesh_dim_names", None) or ()
    used: set[str] = set()
    for p in model.parameters():
        if isinstance(p, DTensor):
            used.update(p.device_mesh.mesh_dim_names or ())
    for i, name in enumerate(names):
        if mesh.size(i) > 1 and name not in used and name not in _WARNED_DIMS:
            _WARNED_DIMS.add(name)
            sizes = ", ".join(f"{n}={mesh.size(j)}" for j, n in enumerate(names))
            warnings.warn(
                f"shardgather: no parameter of the model is placed on the mesh's {name!r} "
                f"dimension ({sizes}): the {mesh.size(i)} ranks along it hold full, "
                "unsynchronised copies, and a checkpoint saves one of them. Pass the sizes "
                "your parallelize function uses, e.g. data_parallel_size=N, "
                "tensor_parallel_size=1 for FSDP alone.",
                stacklevel=_user_stacklevel(),
            )


_WARNED_DIMS: set[str] = set()

# Code a warning must not point into: the user's line is the first frame outside these
# (Lightning calls the strategy from several depths, so no fixed stacklevel finds it).
_FRAMEWORK = ("shardgather", "lightning", "pytorch_lightning", "lightning_fabric", "torch")


def _user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel of the first caller outside shardgather, Lightning
    and torch (called from the function that warns)."""
    frame = sys._getframe(2)  # the function that warns is level 1
    level = 2
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.split(".")[0] not in _FRAMEWORK:
            return level
        frame, level = frame.f_back, level + 1
    return 2


class ModelParallelStrategy(_TrainerCheckpoints, _TrainerModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2), checkpointing through shardgather."""

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if self.model is not None:
            _warn_unused_mesh_dims(self.model, self.device_mesh)


class FSDPStrategy(_TrainerCheckpoints, _TrainerFSDPStrategy):
    """Lightning's ``FSDPStrategy`` (FSDP1; GPUs only in Lightning), checkpointing
    through shardgather."""


class _FabricCheckpoints:
    """Fabric's ``save``/``load`` for a strategy whose modules are sharded."""

    broadcast: Callable[..., Any]
    world_size: int
    checkpoint_timeout: datetime.timedelta = DEFAULT_TIMEOUT

    def save_checkpoint(
        self,
        path: str | os.PathLike,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: Any = None,
    ) -> None:
        if storage_options is not None or filter is not None:
            raise ShardGatherError(
                "storage_options and filter are not supported by shardgather's strategy"
            )
        model, opt, extra = _split(state)
        save_checkpoint(
            self.broadcast(os.fspath(path)),
            model,
            opt,
            extra=_plain(extra),
            timeout=self.checkpoint_timeout,
        )

    def load_checkpoint(
        self,
        path: str | os.PathLike,
        state: nn.Module | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        path = self.broadcast(os.fspath(path))
        if isinstance(state, nn.Module):
            state = {"model": state}
        if not state:
            raise ShardGatherError("fabric.load(path, state) needs a state with the model in it")
        model, opt, wanted = _split(state)
        extra = load_checkpoint(
            path,
            model,
            opt,
            strict=strict,
            trust_pickle=weights_only is False,
            timeout=self.checkpoint_timeout,
        )
        missing = [k for k in wanted if k not in extra]
        if strict and missing:
            raise CheckpointError(f"{path}: the checkpoint has no {missing}")
        for k in wanted:  # Fabric copies these back into the caller's dict
            if k in extra:
                state[k] = extra.pop(k)
        return extra


def _split(
    state: Mapping[str, Any],
) -> tuple[nn.Module, torch.optim.Optimizer | None, dict[str, Any]]:
    """(the model, the optimizer or None, everything else) of a Fabric state dict."""
    modules = [k for k, v in state.items() if isinstance(v, nn.Module)]
    optims = [k for k, v in state.items() if isinstance(v, torch.optim.Optimizer)]
    if len(modules) != 1 or len(optims) > 1:
        raise ShardGatherError(
            "shardgather's Fabric strategies save one model and at most one optimizer per "
            f"checkpoint; this state has models {modules} and optimizers {optims}"
        )
    rest = {k: v for k, v in state.items() if k not in modules and k not in optims}
    return state[modules[0]], state[optims[0]] if optims else None, rest


class FabricModelParallelStrategy(_FabricCheckpoints, _FabricModelParallelStrategy):
    """Fabric's ``ModelParallelStrategy`` (FSDP2), checkpointing through shardgather."""

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = super().setup_module(module)
        _warn_unused_mesh_dims(module, self.device_mesh)
        return module


class FabricFSDPStrategy(_FabricCheckpoints, _FabricFSDPStrategy):
    """Fabric's ``FSDPStrategy`` (FSDP1), checkpointing through shardgather."""
