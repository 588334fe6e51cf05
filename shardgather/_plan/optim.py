"""Optimizer state as plans: element-wise states (``exp_avg``, ``momentum_buffer``...)
share their parameter's shard layout, so each (state name, parameter) is an entry of
a plan whose sources mirror the model's. Gathering builds each source's row from the
optimizer's state; loading writes into fresh rows that become the optimizer's state.

Entry keys are ``"<state name>/<parameter key>"``; the full format is DCP's full
optimizer state dict with the plain model's names::

    {"state": {"layers.0.weight": {"step": tensor(3.), "exp_avg": <full>, ...}, ...},
     "param_groups": [{"lr": ..., "betas": ..., "params": ["layers.0.weight", ...]}, ...]}
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import ShardGatherError, StateDictMismatchError
from . import dtensor, fsdp1, fsdp2
from .types import Entry, GatherPlan, Source, fingerprint, memory_order_flat


@dataclass
class ParamRef:
    """How one optimizer-visible parameter maps onto the model's plan."""

    param: torch.Tensor
    # "flat" (FSDP1 flat param), "orig" (FSDP1 use_orig_params), "fsdp2", "dtensor" (a
    # DTensor FSDP does not manage: tensor/expert parallel), "local"
    kind: str
    source: Source
    keys: list[str]  # primary keys it covers (a flat parameter covers many)
    shard_offset: int = 0  # "orig": where its local elements start in the flat row

    @property
    def empty_here(self) -> bool:
        """use_orig_params with no local elements: torch's optimizers never step it on
        this rank, so it has no state here (its scalars are the other ranks')."""
        return self.kind == "orig" and self.param.numel() == 0


def param_refs(model: nn.Module, plan: GatherPlan) -> dict[int, ParamRef]:
    """id(optimizer-visible parameter) -> its ParamRef."""
    refs: dict[int, ParamRef] = {}
    ident = plan.identities
    for handle in fsdp1.handles(model):
        flat = handle.flat_param
        keys = [ident[("fsdp1", id(flat), i)] for i in range(len(flat._param_infos))]
        src = plan.entries[keys[0]].source
        if getattr(handle, "_use_orig_params", False):
            for i, p in enumerate(flat._params):
                info = flat._shard_param_infos[i]
                offset = info.offset_in_shard if info.in_shard else 0
                refs[id(p)] = ParamRef(p, "orig", src, [keys[i]], offset or 0)
        else:
            refs[id(flat)] = ParamRef(flat, "flat", src, keys)
    # FSDP2: through FSDP's records (the module may hold an unsharded copy just now).
    for fp in fsdp2.params_by_optimizer_param(model).values():
        p = fp.sharded_param  # type: ignore[attr-defined]
        key = ident[("fsdp2", id(fp))]
        refs[id(p)] = ParamRef(p, "fsdp2", plan.entries[key].source, [key])
    for p in model.parameters():
        if id(p) not in refs and ("local", id(p)) in ident:
            key = ident[("local", id(p))]
            kind = "dtensor" if dtensor.is_dtensor(p) else "local"
            refs[id(p)] = ParamRef(p, kind, plan.entries[key].source, [key])
    return refs


def optimizer_refs(
    optimizer: torch.optim.Optimizer, refs: dict[int, ParamRef]
) -> list[list[ParamRef]]:
    """The optimizer's param groups as ParamRefs."""
    out = []
    for g, group in enumerate(optimizer.param_groups):
        row = []
        for p in group["params"]:
            ref = refs.get(id(p))
            if ref is None:
                raise ShardGatherError(
                    f"optimizer param group {g} holds a parameter that is not in the model "
                    f"(shape {tuple(p.shape)}); build the optimizer from model.parameters()"
                )
            row.append(ref)
        out.append(row)
    return out


def is_elementwise(ref: ParamRef, v: Any) -> bool:
    """A state value with one element per parameter element (exp_avg, momentum...)."""
    if not isinstance(v, torch.Tensor) or v.dim() == 0:
        return False
    if ref.kind == "flat":
        return v.dim() == 1 and v.numel() == ref.source.row_numel
    return tuple(v.shape) == tuple(ref.param.shape)


def _state_row(ref: ParamRef, v: torch.Tensor) -> torch.Tensor:
    """This rank's elements of a state value, in the layout of the param's source row."""
    if ref.kind in ("fsdp2", "dtensor"):
        return v.to_local().detach().reshape(-1)
    if ref.kind == "local":
        return memory_order_flat(v.detach())
    return v.detach().reshape(-1)


# What a rank knows of one parameter's states: name -> ("elem", dtype name) | ("scalar", v)
Meta = dict[str, dict[str, tuple]]


def local_meta(refs: list[ParamRef], optimizer: torch.optim.Optimizer) -> Meta:
    """Per primary key, this rank's description of every state it holds."""
    mine: Meta = {}
    for ref in refs:
        if ref.empty_here:
            continue
        for name, v in optimizer.state.get(ref.param, {}).items():
            if is_elementwise(ref, v):
                desc: tuple = ("elem", str(v.dtype).replace("torch.", ""))
            elif isinstance(v, torch.Tensor):
                local = v.to_local() if hasattr(v, "to_local") else v
                desc = ("scalar", local.detach().cpu().clone())
            else:
                desc = ("scalar", v)
            for key in ref.keys:
                mine.setdefault(key, {})[name] = desc
    return mine


def merge_meta(every_rank: list[Meta]) -> Meta:
    """Every rank's meta merged (a rank holding no elements of a parameter may hold no
    state for it): the first rank's description wins."""
    merged: Meta = {}
    for rank_meta in every_rank:
        for key, names in rank_meta.items():
            for name, desc in names.items():
                merged.setdefault(key, {}).setdefault(name, desc)
    return merged


@dataclass
class StatePlan:
    """The optimizer state as a gather plan: one entry per (state name, parameter)."""

    model_plan: GatherPlan
    plan: GatherPlan  # entries keyed "name/param_key"
    meta: Meta
    param_groups: list[dict[str, Any]]  # "params" are clean names

    def assemble(self, gathered: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """The full optimizer state dict from the gathered element-wise tensors."""
        state: dict[str, dict[str, Any]] = {}
        for key in self.model_plan.keys:
            if key in self.model_plan.aliases or key not in self.meta:
                continue
            state[key] = {
                name: gathered[f"{name}/{key}"] if desc[0] == "elem" else _clone(desc[1])
                for name, desc in sorted(self.meta[key].items())
            }
        return {"state": state, "param_groups": [dict(g) for g in self.param_groups]}

    @property
    def scalars(self) -> dict[str, dict[str, Any]]:
        return {
            k: {n: d[1] for n, d in names.items() if d[0] == "scalar"}
            for k, names in self.meta.items()
        }

    @property
    def elements(self) -> dict[str, list[str]]:
        return {
            k: sorted(n for n, d in names.items() if d[0] == "elem")
            for k, names in self.meta.items()
        }


def gather_state_plan(
    model_plan: GatherPlan,
    groups: list[list[ParamRef]],
    meta: Meta,
    optimizer: torch.optim.Optimizer,
) -> StatePlan:
    """The plan that gathers every element-wise state (identical on every rank given the
    same merged meta)."""
    refs = [r for g in groups for r in g]
    names = sorted({n for d in meta.values() for n, desc in d.items() if desc[0] == "elem"})

    def dtype_of(key: str, name: str) -> torch.dtype | None:
        desc = meta.get(key, {}).get(name)
        return getattr(torch, desc[1]) if desc and desc[0] == "elem" else None

    def row_builder(
        rs: list[ParamRef], name: str, dtype: torch.dtype
    ) -> Callable[[], torch.Tensor]:
        def build() -> torch.Tensor:
            if rs[0].kind != "orig":
                v = optimizer.state.get(rs[0].param, {}).get(name)
                if v is None:  # no state on this rank: its row is never read
                    return torch.zeros(0, dtype=dtype)
                return _state_row(rs[0], v)
            # use_orig_params: assemble the flat row from each param's piece of the shard.
            row = torch.zeros(rs[0].source.row_numel, dtype=dtype)
            for r in rs:
                v = optimizer.state.get(r.param, {}).get(name)
                if v is not None and v.numel() > 0:
                    row[r.shard_offset : r.shard_offset + v.numel()] = v.detach().reshape(-1)
            return row

        return build

    plan = _mirror(
        model_plan, refs, names, dtype_of, lambda rs, name, dt: (row_builder(rs, name, dt), None)
    )
    return StatePlan(model_plan, plan, meta, _param_groups(groups, optimizer))


def load_state_plan(
    model_plan: GatherPlan,
    groups: list[list[ParamRef]],
    elements: Mapping[str, Mapping[str, torch.dtype]],
) -> tuple[GatherPlan, dict[tuple[int, str], torch.Tensor]]:
    """A plan whose sources are fresh, zeroed rows (one per parameter source and state
    name) for loading ``elements`` (``{key: {state name: dtype}}``) into: the load engine
    writes each rank's elements into them like into model shards. Returns the plan and
    the rows by ``(model source index, state name)``."""
    refs = [r for g in groups for r in g]
    names = sorted({n for d in elements.values() for n in d})
    rows: dict[tuple[int, str], torch.Tensor] = {}

    def dtype_of(key: str, name: str) -> torch.dtype | None:
        return elements.get(key, {}).get(name)

    def fresh(rs: list[ParamRef], name: str, dtype: torch.dtype):  # type: ignore[no-untyped-def]
        row = torch.zeros(rs[0].source.row_numel, dtype=dtype)
        rows[(rs[0].source.index, name)] = row
        return (lambda row=row: row), (lambda row=row: row)

    return _mirror(model_plan, refs, names, dtype_of, fresh), rows


def _mirror(
    model_plan: GatherPlan,
    refs: list[ParamRef],
    names: list[str],
    dtype_of: Callable[[str, str], torch.dtype | None],
    rows_for: Callable[[list[ParamRef], str, torch.dtype], tuple[Callable, Callable | None]],
) -> GatherPlan:
    """A plan with one source per (model source, state name) in the same layout, and
    one entry per (state name, key) that has that state."""
    entries: dict[str, Entry] = {}
    sources: list[Source] = []
    by_source: dict[int, list[ParamRef]] = {}
    for r in refs:
        by_source.setdefault(r.source.index, []).append(r)
    for name in names:
        for rs in by_source.values():
            keys = [k for r in rs for k in r.keys if dtype_of(k, name) is not None]
            if not keys:
                continue
            dtype = dtype_of(keys[0], name)
            assert dtype is not None
            src0 = rs[0].source
            local, storage = rows_for(rs, name, dtype)
            state_src = Source(
                index=len(sources),
                group=src0.group,
                world=src0.world,
                rank=src0.rank,
                row_numel=src0.row_numel,
                dtype=dtype,
                local=local,
                group_ranks=src0.group_ranks,
                description=f"{name} of {src0.description}",
                storage=storage,
                origin=src0.index,
                device=src0.device,
            )
            sources.append(state_src)
            for k in keys:
                pe = model_plan.entries[k]
                entries[f"{name}/{k}"] = Entry(
                    f"{name}/{k}", pe.shape, pe.stride, dtype, state_src, pe.base, blocks=pe.blocks
                )
    plan = GatherPlan(list(entries), entries, {}, sources, model_plan.rank, model_plan.world)
    plan.fingerprint = fingerprint(plan)
    return plan


def _param_groups(
    groups: list[list[ParamRef]], optimizer: torch.optim.Optimizer
) -> list[dict[str, Any]]:
    out = []
    for group, rs in zip(optimizer.param_groups, groups):
        pg = {k: v for k, v in group.items() if k != "params"}
        pg["params"] = [k for r in rs for k in r.keys]
        out.append(pg)
    return out


def check_groups(groups: list[list[ParamRef]], saved_groups: Any) -> None:
    """The saved param groups name exactly the optimizer's parameters, group by group."""
    if not isinstance(saved_groups, list) or not all(
        isinstance(g, dict)
        and isinstance(g.get("params"), list)
        and all(isinstance(k, str) for k in g["params"])
        for g in saved_groups
    ):
        raise ShardGatherError(
            "osd['param_groups'] must be a list of dicts whose 'params' are parameter names "
            "(from shardgather.full_optim_state_dict)"
        )
    if len(saved_groups) != len(groups):
        raise StateDictMismatchError(
            f"the optimizer has {len(groups)} param groups, the checkpoint {len(saved_groups)}; "
            "build the optimizer with the same groups as when it was saved"
        )
    for g, (rs, saved) in enumerate(zip(groups, saved_groups)):
        mine = [k for r in rs for k in r.keys]
        if set(mine) != set(saved["params"]):
            raise StateDictMismatchError(
                f"param group {g}: missing {sorted(set(mine) - set(saved['params']))}, "
                f"unexpected {sorted(set(saved['params']) - set(mine))}",
                sorted(set(mine) - set(saved["params"])),
                sorted(set(saved["params"]) - set(mine)),
            )


def check_kind(optimizer: Any, saved_groups: Any) -> None:
    """The saved state is this kind of optimizer's: its param groups' settings are not
    another optimizer's (AdamW's ``betas`` where SGD has ``momentum``). A checkpoint of
    another kind would load silently and fail at the next step (``KeyError:
    'momentum'``) or, worse, step with the wrong state. A setting only one side has is
    a torch version's new or dropped default, not another optimizer: allowed."""
    if not isinstance(saved_groups, list):
        return
    for g, (mine, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        if not isinstance(saved, dict):
            return
        here, there = set(mine) - {"params"}, set(saved) - {"params"}
        missing, extra = sorted(here - there), sorted(there - here)
        if missing and extra:
            raise StateDictMismatchError(
                f"the saved optimizer state is not a {type(optimizer).__name__}'s: its "
                f"param group {g} has settings {extra} that {type(optimizer).__name__} does "
                f"not, and lacks {missing}. Build the same optimizer type as the one that "
                "was saved (nothing was loaded)."
            )


# (param groups, scalar states by key, element-wise state dtypes by key): what a
# rank needs, besides the bytes, to load optimizer state it cannot read itself.
Skeleton = tuple[list[dict[str, Any]], dict[str, dict[str, Any]], dict[str, dict[str, torch.dtype]]]


def element_shapes(
    plan: GatherPlan, elements: Mapping[str, Mapping[str, torch.dtype]]
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The optimizer-state plan's entries as a source describes them: key
    ``"<state>/<param>"`` -> (the parameter's shape, the state's dtype)."""
    return {
        f"{name}/{key}": (tuple(plan.entries[key].shape), dtype)
        for key, names in elements.items()
        for name, dtype in names.items()
    }


def groups_fingerprint(groups: list[list[ParamRef]]) -> str:
    """The optimizer's param groups by name: equal on every rank of one job."""
    names = "|".join(",".join(sorted(k for r in rs for k in r.keys)) for rs in groups)
    return hashlib.sha1(names.encode()).hexdigest()[:12]


@dataclass
class LoadedState:
    """What a load hands the optimizer: rows filled by the engine, scalars, groups."""

    rows: dict[tuple[int, str], torch.Tensor]
    scalars: Mapping[str, Mapping[str, Any]]  # key -> state name -> value
    elements: Mapping[str, Mapping[str, torch.dtype]]
    param_groups: list[dict[str, Any]]
    extra: dict[str, Any] = field(default_factory=dict)


def optimizer_state_dict(groups: list[list[ParamRef]], loaded: LoadedState) -> dict[str, Any]:
    """``optimizer.load_state_dict``'s input: this rank's shard of every state value."""
    state: dict[int, dict[str, Any]] = {}
    out_groups = []
    idx = 0
    for rs, saved in zip(groups, loaded.param_groups):
        ids = []
        for r in rs:
            st = _param_state(r, loaded)
            if st:
                state[idx] = st
            ids.append(idx)
            idx += 1
        pg = {k: v for k, v in saved.items() if k != "params"}
        pg["params"] = ids
        out_groups.append(pg)
    return {"state": state, "param_groups": out_groups}


def _param_state(r: ParamRef, loaded: LoadedState) -> dict[str, Any]:
    if r.empty_here:
        return {}  # as torch leaves it: no elements here, no state
    out: dict[str, Any] = {}
    for k in r.keys:
        for name, v in loaded.scalars.get(k, {}).items():
            out.setdefault(name, _clone(v))
    names = sorted({n for k in r.keys for n in loaded.elements.get(k, {})})
    for name in names:
        out[name] = _shaped_like(r, loaded.rows[(r.source.index, name)])
    return out


def _shaped_like(r: ParamRef, row: torch.Tensor) -> Any:
    """A state row as the optimizer holds the value for ``r``'s parameter. Rows of one
    parameter (FSDP2, DTensor, local) are fresh and this value's alone: it takes them as
    they are (a copy doubled the peak of every optimizer load); FSDP1's are shared by the
    parameters of one flat parameter: each takes a copy of its slice."""
    p = r.param
    if r.kind == "flat":
        return row
    if r.kind == "orig":
        n = p.numel()
        return row[r.shard_offset : r.shard_offset + n].clone().reshape(p.shape)
    if r.kind in ("fsdp2", "dtensor"):
        from torch.distributed.tensor import DTensor

        local_shape = p.to_local().shape
        local = row[: math.prod(local_shape)].view(local_shape).to(p.device)
        return DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    return row.as_strided(p.shape, p.stride()) if p.dim() else row.reshape(())


def _clone(v: Any) -> Any:
    return v.clone() if isinstance(v, torch.Tensor) else v
