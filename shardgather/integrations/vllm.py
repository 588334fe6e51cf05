"""Weight sync into a vLLM engine through vLLM's own weight-transfer API.

vLLM's receiving side is a registry of transfer backends driven in four phases
(``init_weight_transfer_engine`` -> ``start_weight_update`` -> ``update_weights`` ->
``finish_weight_update``). This module registers one, ``"shardgather"``, whose
``update_weights`` takes one :meth:`shardgather.WeightSender.sync` — direct from every
trainer rank the first time, then only what changed — and applies it through vLLM's
layerwise reload (the path that handles prepacked CPU linears, processed/quantized
weights and fused names such as ``qkv_proj``/``gate_up_proj``).

Engine side (vLLM's environment; pure Python + torch, no compiled ops needed)::

    from shardgather.integrations import vllm as sg_vllm

    sg_vllm.register()  # or installed: vLLM's plugin entry point does it
    llm = LLM(model=path, weight_transfer_config={"backend": "shardgather"})
    llm.collective_rpc("init_weight_transfer_engine", timeout=120, kwargs={"init_info": {
        "host": trainer_host, "port": port, "trainers": T}})
    # every RL step, while the trainer ranks call sync (below):
    llm.collective_rpc("start_weight_update", timeout=60)
    llm.collective_rpc("update_weights", timeout=600, kwargs={"update_info": {}})
    llm.collective_rpc("finish_weight_update", timeout=60)

Trainer side (the trainer's environment; vLLM is not imported)::

    group = sg.connect_sync_group(host, port, rank=r, world_size=T + engine_ranks)
    sender = sg.WeightSender(model, group, dtype=torch.bfloat16)
    sender.sync()  # every rank, while the engine is in update_weights

How the engine applies a sync, and why:

- The receiver keeps the weights in checkpoint form (the trainer's names, shapes and the
  sent dtype) in host memory: deltas are written into it in place, and it is what vLLM
  is handed. vLLM's layerwise reload keeps references to the tensors it is handed until
  each layer is complete, so they must stay valid and unchanged: these do (nothing is
  written into them until the next sync, after this one's reload).
- Nothing reaches vLLM until the whole sync has arrived: a trainer or the wire failing
  mid-sync leaves the engine serving its previous weights. Then, inside the same
  ``update_weights``, the layers any written name belongs to are reloaded, whole (a
  layer is processed once all its weights are in), one at a time; the trainers' ``sync``
  returns once the engine serves the new weights, and raises if the reload failed.
- The layout (names, shapes) is checked against the checkpoint the engine was started
  from before any data moves: a name the engine's model lacks, or another shape, fails
  both sides at once, and the engine still serves its previous weights.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ShardGatherError, StateDictMismatchError

BACKEND = "shardgather"
_log = logging.getLogger(__name__)


@dataclass
class InitInfo:
    """``init_weight_transfer_engine``'s ``init_info`` for this backend.

    Attributes:
        host: trainer rank 0's address (it hosts the sync group's store).
        port: the sync group's port there (the one the trainer ranks connect to).
        trainers: how many trainer ranks are in the sync group (``T``: every trainer
            rank for a direct sync, 1 for a relayed one).
        rank_offset: this engine's first rank in the group after the trainers (several
            engines: 0, 1, ...); the engine's TP rank ``i`` joins as
            ``trainers + rank_offset + i``.
        world_size: the sync group's size; ``None``: trainers + this engine's ranks.
        timeout_s: the bound of every wait of a sync.
    """

    host: str
    port: int
    trainers: int
    rank_offset: int = 0
    world_size: int | None = None
    timeout_s: float = 600.0


@dataclass
class UpdateInfo:
    """``update_weights``' ``update_info``: nothing is needed (the sync carries its own
    layout); ``full`` is informational (the trainer decides)."""

    full: bool = False


def checkpoint_layout(path: str) -> dict[str, tuple[int, ...]] | None:
    """Name -> shape of the safetensors checkpoint at ``path`` (a directory or file), read
    from the headers alone; None when there is none to read (e.g. a hub name not yet
    downloaded, or a dummy load)."""
    from ..io.hf_layout import safetensors_files
    from ..io.safetensors_format import read_header

    if not path or not os.path.exists(path):
        return None
    try:
        files, _ = safetensors_files(path)
    except ShardGatherError:
        return None
    out: dict[str, tuple[int, ...]] = {}
    for f in files:
        header = read_header(f)
        for key in header.all_keys():
            out[key] = tuple(header.resolve(key).shape)
    return out


def check_layout(
    layout: list[tuple[str, tuple[int, ...], torch.dtype]],
    expected: dict[str, tuple[int, ...]] | None,
) -> None:
    """Refuse a layout the engine cannot load: a name its checkpoint lacks, or another
    shape (dtypes may differ: vLLM casts as it loads)."""
    if expected is None:
        return
    missing = [n for n, _, _ in layout if n not in expected]
    wrong = {
        n: f"sent {list(s)}, the engine's checkpoint has {list(expected[n])}"
        for n, s, _ in layout
        if n in expected and tuple(s) != expected[n]
    }
    if missing or wrong:
        raise StateDictMismatchError(
            f"weight sync into vLLM: the trainer sends tensors the engine's model lacks "
            f"({missing[:3]}) or holds in another shape ({dict(list(wrong.items())[:3])}); "
            "nothing was applied and the engine serves its previous weights. Start the "
            "engine from a checkpoint of the trainer's model (same architecture and "
            "sizes), and sync the names its state dict has.",
            unexpected_keys=missing,
            mismatched=wrong,
        )


def own_copy(
    layout: list[tuple[str, tuple[int, ...], torch.dtype]],
) -> dict[str, torch.Tensor]:
    """The checkpoint-form copy the receiver writes into: one buffer per dtype, a
    contiguous view per name (zeros: a full sync fills every byte before use)."""
    sizes: dict[torch.dtype, int] = {}
    for _, shape, dtype in layout:
        sizes[dtype] = sizes.get(dtype, 0) + math.prod(shape)
    flat = {dt: torch.empty(n, dtype=dt) for dt, n in sizes.items()}
    at = dict.fromkeys(sizes, 0)
    out = {}
    for name, shape, dtype in layout:
        n = math.prod(shape)
        out[name] = flat[dtype][at[dtype] : at[dtype] + n].view(shape)
        at[dtype] += n
    return out


def reload_into(
    model: torch.nn.Module,
    model_config: Any,
    copy: dict[str, torch.Tensor],
    names: list[str],
) -> dict[str, Any]:
    """vLLM's layerwise reload of every layer any of ``names`` belongs to, from
    ``copy``: each such layer gets all of its weights (a layer is processed only once
    all are in), one layer's group per ``load_weights`` call. Returns what was reloaded.
    """
    from vllm.distributed.weight_transfer.base import layerwise_groups
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    touched = set(names)
    # vLLM's own partition: one group per decoder layer (the outermost index in a name)
    groups = [g for g in layerwise_groups(list(copy)) if touched.intersection(g)]
    t0 = time.perf_counter()
    initialize_layerwise_reload(model)
    try:
        for group in groups:
            model.load_weights([(n, copy[n]) for n in group])
    finally:
        # Layers not handed anything get their previous tensors back (vLLM's own
        # fallback): on a failure half-way, so do the ones not reached.
        finalize_layerwise_reload(model, model_config)
    return {
        "groups": len(groups),
        "tensors": sum(map(len, groups)),
        "reload_s": time.perf_counter() - t0,
    }


def register() -> type:
    """Register the ``"shardgather"`` backend with vLLM's weight-transfer registry
    (idempotent; needs vLLM). Returns the engine class."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    existing = WeightTransferEngineFactory._registry.get(BACKEND)
    if existing is not None:
        return existing()
    cls = _engine_class()
    WeightTransferEngineFactory.register_engine(BACKEND, cls)
    return cls


def _engine_class() -> type:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    from ..weight_sync import WeightReceiver, connect_sync_group

    class ShardGatherTransferEngine(WeightTransferEngine):  # type: ignore[misc,type-arg]
        """vLLM's worker side of a shardgather weight sync (see the module doc)."""

        init_info_cls = InitInfo
        update_info_cls = UpdateInfo
        supports_draft_weight_update = False

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.receiver: WeightReceiver | None = None
            self.copy: dict[str, torch.Tensor] = {}
            self.last: dict[str, Any] = {}
            self._expected: dict[str, tuple[int, ...]] | None = None

        def init_transfer_engine(self, init_info: InitInfo) -> None:
            tp_rank = int(getattr(self.parallel_config, "rank", 0) or 0)
            ranks = int(getattr(self.parallel_config, "world_size", 1) or 1)
            rank = init_info.trainers + init_info.rank_offset + tp_rank
            world = init_info.world_size or init_info.trainers + init_info.rank_offset + ranks
            timeout = datetime.timedelta(seconds=init_info.timeout_s)
            group = connect_sync_group(init_info.host, init_info.port, rank, world, timeout=timeout)
            self._expected = checkpoint_layout(str(getattr(self.model_config, "model", "")))
            if self._expected is None:
                _log.warning(
                    "shardgather: no safetensors checkpoint at %r to check the trainer's "
                    "layout against; a mismatch will fail in vLLM's load_weights",
                    getattr(self.model_config, "model", None),
                )
            self.receiver = WeightReceiver(
                group, target=self._target, on_synced=self._reload, timeout=timeout
            )

        def _target(
            self, layout: list[tuple[str, tuple[int, ...], torch.dtype]]
        ) -> dict[str, torch.Tensor]:
            check_layout(layout, self._expected)
            self.copy = {}  # the previous copy is dropped before the new one is made
            self.copy = own_copy(layout)
            return self.copy

        def _reload(self, names: list[str]) -> None:
            self.last.update(reload_into(self.model, self.model_config, self.copy, names))

        def start_weight_update(self) -> None:
            if self.receiver is None:
                raise ShardGatherError(
                    "shardgather weight transfer not initialised: call "
                    "init_weight_transfer_engine first"
                )

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # The base class ends with torch.accelerator.synchronize(), which fails
            # where there is no accelerator (vLLM's CPU build).
            self.receive_weights(self.parse_update_info(update_info))

        def receive_weights(self, update_info: UpdateInfo) -> None:
            if self.receiver is None:
                raise ShardGatherError("shardgather weight transfer not initialised")
            t0 = time.perf_counter()
            self.last = {"reload_s": 0.0}
            got = self.receiver.receive()
            self.last.update(
                mode=got["mode"],
                bytes=got["bytes"],
                names=len(got["names"]),
                update_s=time.perf_counter() - t0,
            )
            if self.device.type != "cpu" and hasattr(torch, "accelerator"):
                torch.accelerator.synchronize()

        def finish_weight_update(self) -> None:
            """Nothing left: the sync was applied, whole, inside ``update_weights``."""

        def shutdown(self) -> None:
            if self.receiver is not None:
                self.receiver.close()
                self.receiver = None
            self.copy = {}

    return ShardGatherTransferEngine


def last_update(worker: Any) -> dict[str, Any]:
    """What the engine's last ``update_weights`` did (mode, bytes, reload time): for
    ``llm.collective_rpc(last_update)``. Plain types only."""
    engine = getattr(worker, "weight_transfer_engine", None)
    return dict(getattr(engine, "last", {}) or {})


__all__: list[str] = [
    "BACKEND",
    "InitInfo",
    "UpdateInfo",
    "check_layout",
    "checkpoint_layout",
    "last_update",
    "register",
    "reload_into",
]
