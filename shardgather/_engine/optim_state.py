"""Optimizer state through the engine: the plans every rank agrees on (one round merges
what each rank's optimizer holds), and the skeleton of a full optimizer state dict —
what a rank that holds no copy of it needs, besides the bytes, to load its share."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._dist import Call
from .._plan import GatherPlan, build_plan
from .._plan import optim as O
from ..errors import ShardGatherError


def state_plan(call: Call, model: nn.Module, optimizer: torch.optim.Optimizer) -> O.StatePlan:
    """The optimizer state's gather plan: every rank's description of the states it
    holds, merged (one round), then the same plan everywhere."""
    plan = build_plan(model)
    groups = O.optimizer_refs(optimizer, O.param_refs(model, plan))
    mine = O.local_meta([r for g in groups for r in g], optimizer)
    every = call.round("optimizer state", same=plan.fingerprint, payload=mine, gather="all")
    return O.gather_state_plan(plan, groups, O.merge_meta(every), optimizer)


def skeleton_of(
    plan: GatherPlan, groups: list[list[O.ParamRef]], osd: dict[str, Any]
) -> tuple[O.Skeleton, dict[str, torch.Tensor]]:
    """(param groups, scalars, element-wise dtypes) and the element-wise tensors of a
    full optimizer state dict, checked against the optimizer."""
    if not isinstance(osd, dict) or "state" not in osd or "param_groups" not in osd:
        raise ShardGatherError(
            "osd must be a dict with 'state' and 'param_groups' "
            "(from shardgather.full_optim_state_dict)"
        )
    O.check_groups(groups, osd["param_groups"])
    scalars: dict[str, dict[str, Any]] = {}
    elements: dict[str, dict[str, torch.dtype]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for key, st in osd["state"].items():
        e = plan.entries.get(key)
        for name, v in st.items():
            if (
                e is not None
                and isinstance(v, torch.Tensor)
                and v.dim() > 0
                and tuple(v.shape) == tuple(e.shape)
            ):
                elements.setdefault(key, {})[name] = v.dtype
                tensors[f"{name}/{key}"] = v
            else:
                scalars.setdefault(key, {})[name] = v
    return (osd["param_groups"], scalars, elements), tensors
