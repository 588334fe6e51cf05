"""FSDP2 (``fully_shard``) internals: every FSDPParam, keyed by where it is registered
(not by the tensor the module holds), and its padded dim-0 shard as a source."""

from __future__ import annotations

import torch
from torch import nn

from .._layout import Block
from ..errors import UnsupportedModelError
from . import dtensor
from .types import Source


def param_records(model: nn.Module) -> list[object]:
    """Every FSDPParam of every fully_shard'ed module under ``model``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    out: list[object] = []
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            single = getattr(state, "_fsdp_param_group", None)
            groups = [single] if single is not None else []
        for g in groups:
            out.extend(g.fsdp_params)
    return out


def params_by_module(model: nn.Module) -> dict[tuple[int, str], object]:
    """(id(module), parameter name) -> its FSDPParam, tied registrations included.

    Keyed by FSDP's own records of where each parameter is registered, not by the
    tensor the module holds: after a forward under ``torch.no_grad()`` FSDP2 leaves
    the root's parameters unsharded, so the module then holds a plain full tensor,
    not the sharded DTensor (which the optimizer holds, and which is the truth).
    """
    out: dict[tuple[int, str], object] = {}
    for fp in param_records(model):
        info = fp._module_info
        out[(id(info.module), info.param_name)] = fp
        for mod, name in zip(info.shared_modules, info.shared_param_names):
            out[(id(mod), name)] = fp
    return out


def params_by_optimizer_param(model: nn.Module) -> dict[int, object]:
    """id(sharded DTensor parameter, as the optimizer holds it) -> its FSDPParam."""
    return {id(fp.sharded_param): fp for fp in param_records(model)}


def source_of(fp, key: str, sources: list[Source]) -> tuple[Source, tuple[Block, ...] | None]:  # type: ignore[no-untyped-def]
    """FSDP2's sharded parameter as a source: a DTensor on FSDP's mesh (1-D, HSDP, or
    with TP/EP dims), its local tensor at the start of FSDP's padded shard (which is
    where a load writes). Rows are as long as the largest local tensor: over TP split
    unevenly, FSDP's padded shards differ between TP ranks. Returns the source and the
    entry's blocks (None: dim-0 shards of the whole tensor, one run from 0)."""

    def local(fp=fp) -> torch.Tensor:
        return fp.sharded_param.to_local().detach().reshape(-1)

    def storage(fp=fp) -> torch.Tensor:
        # The padded row FSDP2 all-gathers from; the DTensor's local tensor views it.
        data = getattr(fp, "_sharded_param_data", None)
        local = fp.sharded_param.to_local()
        if data is None or (local.numel() > 0 and local.data_ptr() != data.data_ptr()):
            raise UnsupportedModelError(
                f"{key!r}: cannot find FSDP2's padded shard storage to load into"
            )
        return data

    return dtensor.source_of(
        key,
        fp.sharded_param,
        sources,
        local=local,
        storage=storage,
        description=f"FSDP2 parameter {key}",
    )


def reshard(model: nn.Module) -> None:
    """Reshard every FSDP2 module (its public API; a no-op when already sharded)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
