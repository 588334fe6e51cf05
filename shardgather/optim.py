"""Full optimizer state keyed by clean parameter names, gathered with the same plan
and engine as the model (state tensors share their parameter's shard layout), and
loaded back shard by shard into any world size or FSDP flavour.

Format (DCP's full optimizer state dict, with the plain model's names)::

    {"state": {"layers.0.weight": {"step": tensor(3.), "exp_avg": <full>, ...}, ...},
     "param_groups": [{"lr": ..., "betas": ..., "params": ["layers.0.weight", ...]}, ...]}
"""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import _layout as L
from . import _ops
from ._collectives import agree, p2p_device, receive_from_rank0, scatter_slice
from ._options import DEFAULT_TIMEOUT, verify_options, verify_transport
from ._plan import (
    Entry,
    GatherPlan,
    Source,
    build_plan,
    fingerprint,
    flat_of,
    memory_order_flat,
    own_range,
)
from .api import gather_plan
from .errors import CheckpointError, ShardGatherError, StateDictMismatchError
from .io.safetensors_format import Header, TensorInfo, pread_into


@dataclass
class _ParamRef:
    """How an optimizer-visible parameter maps onto the plan."""

    param: torch.Tensor
    kind: str  # "flat" (FSDP1 flat param), "orig" (FSDP1 use_orig_params), "fsdp2", "local"
    source: Source
    keys: list[str]  # primary keys it covers (a flat parameter covers many)
    shard_offset: int = 0  # "orig": where its local elements start in the flat row


def _param_refs(model: nn.Module, plan: GatherPlan) -> dict[int, _ParamRef]:
    """id(optimizer-visible parameter) -> its _ParamRef."""
    from torch.distributed.fsdp import _traversal_utils

    from ._plan import fsdp2_optimizer_params

    refs: dict[int, _ParamRef] = {}
    ident = plan.identities
    for handle in _traversal_utils._get_fsdp_handles(model):
        flat = handle.flat_param
        keys = [ident[("fsdp1", id(flat), i)] for i in range(len(flat._param_infos))]
        src = plan.entries[keys[0]].source
        if getattr(handle, "_use_orig_params", False):
            for i, p in enumerate(flat._params):
                info = flat._shard_param_infos[i]
                offset = info.offset_in_shard if info.in_shard else 0
                refs[id(p)] = _ParamRef(p, "orig", src, [keys[i]], offset or 0)
        else:
            refs[id(flat)] = _ParamRef(flat, "flat", src, keys)
    # FSDP2: through FSDP's records (the module may hold an unsharded copy just now).
    for fp in fsdp2_optimizer_params(model).values():
        p = fp.sharded_param  # type: ignore[attr-defined]
        key = ident[("fsdp2", id(fp))]
        refs[id(p)] = _ParamRef(p, "fsdp2", plan.entries[key].source, [key])
    for p in model.parameters():
        if id(p) in refs:
            continue
        if ("local", id(p)) in ident:
            key = ident[("local", id(p))]
            refs[id(p)] = _ParamRef(p, "local", plan.entries[key].source, [key])
    return refs


def _is_elementwise(ref: _ParamRef, v: Any) -> bool:
    """A state value with one element per parameter element (exp_avg, momentum...)."""
    if not isinstance(v, torch.Tensor) or v.dim() == 0:
        return False
    if ref.kind == "flat":
        return v.dim() == 1 and v.numel() == ref.source.row_numel
    return tuple(v.shape) == tuple(ref.param.shape)


def _local_row(ref: _ParamRef, v: torch.Tensor) -> torch.Tensor:
    """This rank's elements of a state value, in the layout of the param's source row."""
    if ref.kind == "fsdp2":
        return v.to_local().detach().reshape(-1)
    if ref.kind == "local":
        return memory_order_flat(v.detach())
    return v.detach().reshape(-1)


def _exchange_meta(refs: list[_ParamRef], optimizer: torch.optim.Optimizer) -> dict:
    """Per primary key: {state name: ("elem", dtype) | ("scalar", value)}, merged over
    ranks (a rank holding no elements of a parameter may hold no state for it)."""
    mine: dict[str, dict[str, tuple]] = {}
    for ref in refs:
        if ref.kind == "orig" and ref.param.numel() == 0:
            # No local elements: torch's optimizers never step it here, so its scalars
            # (e.g. "step") are stale; the ranks holding its elements report them.
            continue
        st = optimizer.state.get(ref.param, {})
        for name, v in st.items():
            if _is_elementwise(ref, v):
                desc: tuple = ("elem", str(v.dtype).replace("torch.", ""))
            elif isinstance(v, torch.Tensor):
                local = v.to_local() if hasattr(v, "to_local") else v
                desc = ("scalar", local.detach().cpu().clone())
            else:
                desc = ("scalar", v)
            for key in ref.keys:
                mine.setdefault(key, {})[name] = desc
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged: dict[str, dict[str, tuple]] = {}
    for rank_meta in everyone:
        for key, names in rank_meta.items():
            for name, desc in names.items():
                merged.setdefault(key, {}).setdefault(name, desc)
    return merged


def _opt_refs(
    optimizer: torch.optim.Optimizer, refs: dict[int, _ParamRef]
) -> list[list[_ParamRef]]:
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


def full_optim_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    rank0_only: bool = True,
    bucket_mb: float | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    transport: str = "auto",
) -> dict[str, Any]:
    """The full optimizer state, keyed by the plain model's parameter names.

    Call on every rank. State tensors (``exp_avg``, ``momentum_buffer``...) are
    gathered like their parameters (same plan, buckets and kernels); scalars such as
    ``step`` are taken as they are. FSDP1 flat parameters are split back into the
    original parameters.

    Args:
        model, optimizer: the (sharded) model and the optimizer built on its parameters.
        rank0_only: only global rank 0 gets the dict (others ``{}``).
        bucket_mb, timeout, transport: as for :func:`shardgather.full_state_dict`.

    Returns:
        ``{"state": {name: {state: value}}, "param_groups": [{..., "params": [name]}]}``.

    Example:
        >>> osd = shardgather.full_optim_state_dict(model, optimizer)
    """
    verify_options(model, bucket_mb, None)
    verify_transport(transport, False)
    st = state_plan(model, optimizer, timeout)
    gathered = gather_plan(
        st.plan, rank0_only=rank0_only, bucket_mb=bucket_mb, timeout=timeout, transport=transport
    )
    if gathered is None:
        return {}
    return st.assemble(gathered)


@dataclass
class StatePlan:
    """The optimizer state as a gather plan: one entry per (state name, parameter)."""

    model_plan: GatherPlan
    plan: GatherPlan  # entries keyed "name/param_key"
    meta: dict[str, dict[str, tuple]]  # key -> state name -> ("elem", dtype) | ("scalar", v)
    param_groups: list[dict[str, Any]]  # "params" are clean names

    def assemble(self, gathered: dict[str, torch.Tensor]) -> dict[str, Any]:
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


def state_plan(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> StatePlan:
    """Build and agree on the optimizer-state plan (collective: call on every rank)."""
    plan = build_plan(model)
    agree(plan, timeout)
    refs = _param_refs(model, plan)
    groups = _opt_refs(optimizer, refs)
    flat_refs = [r for g in groups for r in g]
    meta = _exchange_meta(flat_refs, optimizer)

    # One synthetic plan for every element-wise state: sources mirror the params'.
    entries: dict[str, Entry] = {}
    sources: list[Source] = []
    names = sorted({n for d in meta.values() for n, desc in d.items() if desc[0] == "elem"})
    by_source: dict[int, list[_ParamRef]] = {}
    for r in flat_refs:
        by_source.setdefault(r.source.index, []).append(r)
    for name in names:
        for rs in by_source.values():
            keys = [k for r in rs for k in r.keys if meta.get(k, {}).get(name, ("",))[0] == "elem"]
            if not keys:
                continue
            dtype = getattr(torch, meta[keys[0]][name][1])
            src0 = rs[0].source
            state_src = Source(
                index=len(sources),
                group=src0.group,
                world=src0.world,
                rank=src0.rank,
                row_numel=src0.row_numel,
                dtype=dtype,
                local=_row_builder(rs, name, optimizer, src0.row_numel, dtype),
                group_ranks=src0.group_ranks,
                description=f"{name} of {src0.description}",
            )
            sources.append(state_src)
            for k in keys:
                pe = plan.entries[k]
                entries[f"{name}/{k}"] = Entry(
                    f"{name}/{k}", pe.shape, pe.stride, dtype, state_src, pe.base
                )
    splan = GatherPlan(list(entries), entries, {}, sources, plan.rank, plan.world)
    splan.fingerprint = fingerprint(splan)
    agree(splan, timeout)
    param_groups = []
    for group, rs in zip(optimizer.param_groups, groups):
        pg = {k: v for k, v in group.items() if k != "params"}
        pg["params"] = [k for r in rs for k in r.keys]
        param_groups.append(pg)
    return StatePlan(plan, splan, meta, param_groups)


def _clone(v: Any) -> Any:
    return v.clone() if isinstance(v, torch.Tensor) else v


def _row_builder(
    rs: list[_ParamRef],
    name: str,
    optimizer: torch.optim.Optimizer,
    row_numel: int,
    dtype: torch.dtype,
):  # type: ignore[no-untyped-def]
    def build() -> torch.Tensor:
        if rs[0].kind != "orig":
            st = optimizer.state.get(rs[0].param, {})
            v = st.get(name)
            if v is None:  # no state on this rank: its row is never read
                return torch.zeros(0, dtype=dtype)
            return _local_row(rs[0], v)
        # use_orig_params: assemble the flat row from each param's piece of the shard.
        row = torch.zeros(row_numel, dtype=dtype)
        for r in rs:
            v = optimizer.state.get(r.param, {}).get(name)
            if v is not None and v.numel() > 0:
                row[r.shard_offset : r.shard_offset + v.numel()] = v.detach().reshape(-1)
        return row

    return build


def load_full_optim_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    osd: dict[str, Any],
    *,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> None:
    """Load a full optimizer state (from :func:`full_optim_state_dict`, any world size
    or FSDP flavour) into ``optimizer``: each rank keeps only its shard of every state
    tensor. ``osd`` on every rank, or on rank 0 only (``{}`` elsewhere: its scalars and
    shapes are broadcast once, then rank 0 sends every rank just its own elements of
    each state tensor, one tensor at a time).

    Raises:
        StateDictMismatchError: the param groups or parameter names do not match;
            nothing is loaded.
    """
    plan = build_plan(model)
    agree(plan, timeout)
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, bool(osd))
        if not all(everyone):
            if not everyone[0]:
                raise ShardGatherError("load_full_optim_state_dict: rank 0 has no osd to load")
            osd = _from_rank0(osd if dist.get_rank() == 0 else None, plan, timeout)
    if not isinstance(osd, dict) or "state" not in osd or "param_groups" not in osd:
        raise ShardGatherError(
            "osd must be a dict with 'state' and 'param_groups' "
            "(from shardgather.full_optim_state_dict)"
        )
    refs = _param_refs(model, plan)
    groups = _opt_refs(optimizer, refs)
    saved_groups = osd["param_groups"]
    _check_groups(groups, saved_groups)
    if isinstance(osd["state"], _Rank0State):
        osd["state"].exchange_ranges(plan, [r for rs in groups for r in rs])
    state: dict[int, dict[str, Any]] = {}
    out_groups = []
    idx = 0
    for rs, saved in zip(groups, saved_groups):
        ids = []
        for r in rs:
            st = _local_state(r, plan, osd["state"])
            if st:
                state[idx] = st
            ids.append(idx)
            idx += 1
        pg = {k: v for k, v in saved.items() if k != "params"}
        pg["params"] = ids
        out_groups.append(pg)
    optimizer.load_state_dict({"state": state, "param_groups": out_groups})


def _check_groups(groups: list[list[_ParamRef]], saved_groups: Any) -> None:
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


def check_saved_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    param_groups: Any,
    shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    elements: Mapping[str, list[str]],
) -> None:
    """Check, before anything is loaded, that saved optimizer state fits ``optimizer``:
    the same param groups and, for every element-wise state ``elements[key]``, a
    tensor ``shapes["name/key"]`` shaped like the parameter. No collective.

    Raises:
        StateDictMismatchError / CheckpointError: what does not fit, by name.
    """
    plan = build_plan(model)
    _check_groups(_opt_refs(optimizer, _param_refs(model, plan)), param_groups)
    for key, names in elements.items():
        e = plan.entries.get(key)
        if e is None:
            raise StateDictMismatchError(
                f"the checkpoint holds optimizer state for {key!r}, which the model lacks",
                unexpected_keys=[key],
            )
        for name in names:
            got = shapes.get(f"{name}/{key}")
            if got is None:
                raise CheckpointError(f"optimizer state {name!r} of {key!r} is missing")
            if tuple(got[0]) != tuple(e.shape):
                raise StateDictMismatchError(
                    f"optimizer state {name!r} of {key!r}: {got[1]} {tuple(got[0])} in the "
                    f"checkpoint, the parameter is {tuple(e.shape)}",
                    mismatched={key: f"{name}: shape {tuple(got[0])}"},
                )


class _SavedSlice:
    """A saved state tensor shaped like its parameter, of which each rank fetches only
    its own elements (from rank 0 or from a file)."""

    dtype: torch.dtype

    def fetch(self, e: Entry, src: Source) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def read_into(self, e: Entry, src: Source, rows: torch.Tensor, dtype: torch.dtype) -> None:
        """This rank's elements, cast to ``dtype``, into its row (uint8 ``[1, bytes]``).
        One part at a time: a parameter's parts are never all held at once."""
        lo, hi = own_range(e, src)
        part = self.fetch(e, src)
        if hi > lo:
            seg = L.Segment(
                e.base + lo,
                src.row_numel,
                0,
                hi - lo,
                0,
                0,
                L.kind_of(dtype),
                L.kind_of(part.dtype),
            )
            _ops.copy_in([part], L.segment_table([seg]), rows, src.rank)


def _skeleton_value(v: Any, entry: Entry | None) -> tuple:
    """How one state value of rank 0 travels: a tensor shaped like its parameter as
    per-rank slices, other tensors whole when read, anything else in the skeleton."""
    if not isinstance(v, torch.Tensor):
        return ("value", v)
    if entry is not None and v.dim() > 0 and tuple(v.shape) == tuple(entry.shape):
        return ("slice", v.dtype)
    if v.numel() <= 64:
        return ("value", v)
    return ("tensor", tuple(v.shape), v.dtype)


def _from_rank0(
    osd: dict[str, Any] | None, plan: GatherPlan, timeout: datetime.timedelta
) -> dict[str, Any]:
    """Rank 0's osd as every rank sees it: param groups and scalars broadcast once,
    state tensors sent when read (_Rank0State)."""
    skeleton: list[Any] = [None]
    if osd is not None:
        if not isinstance(osd, dict) or "state" not in osd or "param_groups" not in osd:
            skeleton[0] = {"bad": True}
        else:
            skeleton[0] = {
                "param_groups": osd["param_groups"],
                "state": {
                    k: {n: _skeleton_value(v, plan.entries.get(k)) for n, v in st.items()}
                    for k, st in osd["state"].items()
                },
            }
    dist.broadcast_object_list(skeleton, src=0)
    if skeleton[0].get("bad"):
        return {}
    real = osd["state"] if osd is not None else None
    return {
        "param_groups": skeleton[0]["param_groups"],
        "state": _Rank0State(skeleton[0]["state"], real, timeout),
    }


class _Rank0State(Mapping):
    """``{key: {name: value}}`` of rank 0's optimizer state on every rank: scalars from
    the skeleton, each tensor broadcast from rank 0 when read. Every rank must read the
    same tensors in the same order (``_local_state`` does)."""

    def __init__(
        self,
        skeleton: dict[str, dict[str, Any]],
        real: Mapping | None,
        timeout: datetime.timedelta,
    ) -> None:
        self._skeleton = skeleton
        self._real = real
        self.timeout = timeout
        self.ranges: list[dict[str, tuple[int, int]]] = []  # every rank's, per key

    def exchange_ranges(self, plan: GatherPlan, refs: list[_ParamRef]) -> None:
        """Every rank's element range of every key it loads, known to rank 0."""
        mine = {k: own_range(plan.entries[k], r.source) for r in refs for k in r.keys}
        self.ranges = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(self.ranges, mine)

    def __getitem__(self, key: str) -> Mapping[str, Any]:
        if key not in self._skeleton:
            raise KeyError(key)
        real = self._real[key] if self._real else None
        return _Rank0Entry(self, key, self._skeleton[key], real)

    def __iter__(self) -> Iterator[str]:
        return iter(self._skeleton)

    def __len__(self) -> int:
        return len(self._skeleton)


class _Rank0Entry(Mapping):
    def __init__(
        self, state: _Rank0State, key: str, skeleton: dict[str, tuple], real: Mapping | None
    ) -> None:
        self._state = state
        self._key = key
        self._skeleton = skeleton
        self._real = real

    def __getitem__(self, name: str) -> Any:
        kind, *rest = self._skeleton[name]
        if kind == "value":
            return rest[0]
        mine = self._real[name] if self._real is not None else None
        if kind == "slice":
            return _RemoteSlice(self._state, self._key, rest[0], mine)
        return receive_from_rank0(mine, (rest[0], rest[1])).cpu()

    def __iter__(self) -> Iterator[str]:
        return iter(self._skeleton)

    def __len__(self) -> int:
        return len(self._skeleton)


class _RemoteSlice(_SavedSlice):
    """A state tensor shaped like its parameter that only rank 0 holds: ``fetch`` gives
    this rank its own elements. Every rank calls it at the same point; rank 0 then
    sends every other rank its range of the tensor, point to point."""

    def __init__(
        self, state: _Rank0State, key: str, dtype: torch.dtype, full: torch.Tensor | None
    ) -> None:
        self.state, self.key, self.dtype, self.full = state, key, dtype, full

    def fetch(self, e: Entry, src: Source) -> torch.Tensor:
        """This rank's elements of the tensor (its range of ``e`` in ``src``'s row)."""
        ranges = [r.get(self.key) for r in self.state.ranges]
        flat = flat_of(e, self.full).to(p2p_device()) if self.full is not None else None
        got: list[torch.Tensor] = []
        scatter_slice(
            flat, ranges, self.dtype, self.state.timeout, f"state of {self.key}", got.append
        )
        lo, hi = own_range(e, src)
        return got[0].cpu() if got else torch.empty(max(hi - lo, 0), dtype=self.dtype)


def _local_state(r: _ParamRef, plan: GatherPlan, full_state: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's shard of every state value of one optimizer parameter."""
    per_key = [full_state.get(k, {}) for k in r.keys]
    names = sorted({n for st in per_key for n in st})
    if r.kind == "orig" and r.param.numel() == 0:
        # As torch leaves it: no elements here, no state. Rank 0's state is read anyway
        # (broadcasts, when only rank 0 has it: every rank takes part in each one).
        if isinstance(full_state, _Rank0State):
            for name in names:
                for k, st in zip(r.keys, per_key):
                    v = st.get(name)
                    if isinstance(v, _RemoteSlice):
                        v.fetch(plan.entries[k], r.source)
        return {}
    out: dict[str, Any] = {}
    src = r.source
    for name in names:
        vals = [st.get(name) for st in per_key]
        v0 = next(v for v in vals if v is not None)
        full_elem = isinstance(v0, _SavedSlice) or (
            isinstance(v0, torch.Tensor)
            and v0.dim() > 0
            and tuple(v0.shape) == tuple(plan.entries[r.keys[0]].shape)
        )
        if not full_elem:
            out[name] = _clone(v0)
            continue
        dtype = v0.dtype
        row = torch.zeros(src.row_numel, dtype=dtype)
        rows = row.view(torch.uint8).view(1, -1)
        fulls, segs = [], []
        for k, v in zip(r.keys, vals):
            if v is None:
                continue
            e = plan.entries[k]
            if isinstance(v, _SavedSlice):
                v.read_into(e, src, rows, dtype)
                continue
            fulls.append(flat_of(e, v))
            segs.append(
                L.Segment(
                    e.base,
                    src.row_numel,
                    0,
                    e.numel,
                    len(fulls) - 1,
                    0,
                    L.kind_of(dtype),
                    L.kind_of(v.dtype),
                )
            )
        if fulls:
            _ops.copy_in(fulls, L.segment_table(segs), rows, src.rank)
        out[name] = _shape_like(r, row)
    return out


def _shape_like(r: _ParamRef, row: torch.Tensor) -> Any:
    p = r.param
    if r.kind == "flat":
        return row
    if r.kind == "orig":
        n = p.numel()
        return row[r.shard_offset : r.shard_offset + n].clone().reshape(p.shape)
    if r.kind == "fsdp2":
        from torch.distributed.tensor import DTensor

        local_shape = p.to_local().shape
        local = row[: math.prod(local_shape)].clone().reshape(local_shape).to(p.device)
        return DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    return row.clone().as_strided(p.shape, p.stride()) if p.dim() else row.clone().reshape(())


class FileState(Mapping):
    """``{param key: {state name: value}}`` of a checkpoint directory's optimizer state:
    scalars from its metadata, element-wise states as slices of ``optim.safetensors``
    of which each rank preads only its own elements (the header validated first)."""

    def __init__(
        self,
        path: str,
        header: Header,
        scalars: Mapping[str, Mapping[str, Any]],
        elements: Mapping[str, list[str]],
    ) -> None:
        self._path, self._header = path, header
        self._scalars, self._elements = scalars, elements

    def __getitem__(self, key: str) -> dict[str, Any]:
        if key not in self._elements and key not in self._scalars:
            raise KeyError(key)
        out: dict[str, Any] = dict(self._scalars.get(key, {}))
        for name in self._elements.get(key, []):
            out[name] = _FileSlice(self._path, self._header.tensors[f"{name}/{key}"])
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(set(self._elements) | set(self._scalars)))

    def __len__(self) -> int:
        return len(set(self._elements) | set(self._scalars))


class _FileSlice(_SavedSlice):
    def __init__(self, path: str, info: TensorInfo) -> None:
        self.path, self.info, self.dtype = path, info, info.dtype

    def read_into(self, e: Entry, src: Source, rows: torch.Tensor, dtype: torch.dtype) -> None:
        if not (e.is_contiguous and dtype == self.dtype and rows.device.type == "cpu"):
            return super().read_into(e, src, rows, dtype)
        # The file's row-major bytes are the row's: pread them straight into place.
        lo, hi = own_range(e, src)
        if hi <= lo:
            return None
        size = self.dtype.itemsize
        start = (e.base + lo - src.rank * src.row_numel) * size
        fd = os.open(self.path, os.O_RDONLY)
        try:
            pread_into(fd, rows[0, start : start + (hi - lo) * size], self.info.begin + lo * size)
        finally:
            os.close(fd)
        return None

    def fetch(self, e: Entry, src: Source) -> torch.Tensor:
        lo, hi = own_range(e, src)
        size = self.dtype.itemsize
        fd = os.open(self.path, os.O_RDONLY)
        try:
            if e.is_contiguous:  # the file's row-major order is the shard's
                buf = torch.empty(max(hi - lo, 0) * size, dtype=torch.uint8)
                pread_into(fd, buf, self.info.begin + lo * size)
                return buf.view(self.dtype)
            raw = torch.empty(self.info.numel * size, dtype=torch.uint8)
            pread_into(fd, raw, self.info.begin)
        finally:
            os.close(fd)
        return flat_of(e, raw.view(self.dtype).view(self.info.shape))[lo:hi].clone()
