"""The gather plan: what every output key is made of, built from FSDP metadata alone.

No collectives run here, so the plan is identical on every rank and testable from
metadata. A *source* is a 1-D buffer that every rank of its shard group holds one
equal-sized padded row of (FSDP1: a flat parameter's shard; FSDP2: one parameter's
padded dim-0 shard; a local tensor: a source of one row). An *entry* is one output
key: its shape/stride/dtype and where its elements live in its source (``base``).
Tied aliases point at their primary entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .errors import UnsupportedModelError


@dataclass
class Source:
    """A 1-D row-sharded buffer: ``world`` rows of ``row_numel`` elements each."""

    index: int
    group: dist.ProcessGroup | None  # None: a local tensor, nothing to gather
    world: int
    rank: int  # this process's row
    row_numel: int  # P: padded elements per row, equal on every rank
    dtype: torch.dtype
    local: Callable[[], torch.Tensor]  # this rank's row: 1-D, <= row_numel elements
    group_ranks: tuple[int, ...] = ()
    description: str = ""
    # The live storage of this rank's padded row, for loading in place (None: the
    # row cannot be written in place).
    storage: Callable[[], torch.Tensor] | None = None

    @property
    def row_bytes(self) -> int:
        return self.row_numel * self.dtype.itemsize


@dataclass
class Entry:
    """One key of the output state dict."""

    key: str
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype  # the stored (full-precision) dtype
    source: Source
    base: int  # element offset of element 0 (in memory order) in the source's flat layout
    is_buffer: bool = False
    out_dtype: torch.dtype | None = None  # dtype to produce (None: same as dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def target_dtype(self) -> torch.dtype:
        return self.out_dtype or self.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.target_dtype.itemsize

    @property
    def is_contiguous(self) -> bool:
        return self.numel <= 1 or tuple(self.stride) == _contiguous_stride(self.shape)


@dataclass
class GatherPlan:
    """Every output key in ``state_dict()`` order, with aliases for tied tensors."""

    keys: list[str]  # all keys, plain-model order
    entries: dict[str, Entry]  # primary keys only
    aliases: dict[str, str]  # alias key -> primary key
    sources: list[Source]
    rank: int
    world: int
    fingerprint: str = field(default="")
    # Storage identity -> primary key: ("fsdp1", id(flat_param), index),
    # ("fsdp2", id(FSDPParam)) or ("local", id(tensor)). Optimizer state uses it.
    identities: dict[object, str] = field(default_factory=dict)

    def entries_by_source(self) -> dict[int, list[Entry]]:
        out: dict[int, list[Entry]] = {}
        for e in self.entries.values():
            out.setdefault(e.source.index, []).append(e)
        for lst in out.values():
            lst.sort(key=lambda e: e.base)
        return out


def _contiguous_stride(shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    stride: list[int] = []
    acc = 1
    for d in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))


def _is_dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last) or (t.dim() == 0)


def memory_order_flat(t: torch.Tensor) -> torch.Tensor:
    """The elements of a dense tensor in memory order, 1-D (no copy)."""
    if t.numel() == 0:
        return t.reshape(0)
    return t.as_strided((t.numel(),), (1,))


# --------------------------------------------------------------------------- wrappers


def _wrapper_child_name(module: nn.Module) -> str | None:
    """The child a wrapper forwards to: its state is that child's, under the same name."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    if isinstance(module, FSDP1):
        return "_fsdp_wrapped_module"
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

        if isinstance(module, ActivationWrapper):
            return "_checkpoint_wrapped_module"
    except ImportError:  # pragma: no cover - older torch
        pass
    if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return "module"
    opt_cls = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    opt_cls = getattr(opt_cls, "OptimizedModule", None)
    if opt_cls is not None and isinstance(module, opt_cls):
        return "_orig_mod"
    return _delegate_child_name(module)


def _delegate_child_name(module: nn.Module) -> str | None:
    """The child a *delegating* wrapper hands ``state_dict()`` to, found by structure.

    A module whose class overrides ``state_dict``, that holds no tensors of its own,
    and whose children all reach one and the same module (after the known wrappers:
    FSDP1, DDP, compile, activation checkpointing) can only be showing that module's
    state: Lightning's ``_FabricModule`` registers the user's module twice
    (``_forward_module``, ``_original_module``) and delegates to it; user and
    framework wrappers that forward ``state_dict()`` to one inner module look the
    same. A container that does not override ``state_dict`` is never skipped: torch
    prefixes its children's keys, and so do we.
    """
    if type(module).state_dict is nn.Module.state_dict:
        return None
    if any(p is not None for p in module._parameters.values()) or any(
        b is not None and n not in module._non_persistent_buffers_set
        for n, b in module._buffers.items()
    ):
        return None
    children = [(n, c) for n, c in module._modules.items() if c is not None]
    if not children or len({id(unwrap(c)) for _, c in children}) != 1:
        return None
    target = unwrap(children[0][1])
    # Prefer the child that is the module itself (Lightning's _original_module) over
    # a wrapper of it: the walk unwraps either way.
    return next((n for n, c in children if c is target), children[0][0])


def unwrap(module: nn.Module) -> nn.Module:
    """The innermost module under top-level wrappers (DDP, torch.compile, FSDP1, AC)."""
    while (child := _wrapper_child_name(module)) is not None:
        module = getattr(module, child)
    return module


# --------------------------------------------------------------------------- FSDP metadata


@dataclass
class _FlatRef:
    source: Source
    base: int
    shape: torch.Size
    stride: tuple[int, ...]
    identity: tuple[str, int, int]  # ("fsdp1", id(flat_param), param index): aliases share it


def _group_info(group: dist.ProcessGroup | None) -> tuple[int, int, tuple[int, ...]]:
    if group is None or not dist.is_initialized():
        return 1, 0, (0,)
    ranks = tuple(dist.get_process_group_ranks(group))
    return dist.get_world_size(group), dist.get_rank(group), ranks


def _fsdp1_refs(model: nn.Module, sources: list[Source]) -> dict[tuple[int, str], _FlatRef]:
    """(id(module), param name) -> where the param lives in its FSDP1 flat parameter."""
    from torch.distributed.fsdp import _traversal_utils

    refs: dict[tuple[int, str], _FlatRef] = {}
    for handle in _traversal_utils._get_fsdp_handles(model):
        flat = handle.flat_param
        sharded = bool(getattr(handle, "uses_sharded_strategy", True))
        group = handle.process_group if sharded else None
        world, rank, ranks = _group_info(group)
        if sharded:
            row_numel = int(flat._sharded_size.numel())
        else:
            row_numel = int(flat._unpadded_unsharded_size.numel())

        def local(flat=flat, sharded=sharded) -> torch.Tensor:
            # `_local_shard` is the full-precision shard (mixed precision keeps its
            # low-precision copy elsewhere); before lazy init it does not exist yet
            # and `flat_param.data` is that shard.
            t = getattr(flat, "_local_shard", None) if sharded else None
            return (t if t is not None else flat).detach().reshape(-1)

        src = Source(
            index=len(sources),
            group=group,
            world=world,
            rank=rank,
            row_numel=row_numel,
            dtype=flat.dtype,
            local=local,
            group_ranks=ranks,
            description="FSDP1 flat parameter of " + ", ".join(flat._fqns[:3]),
            storage=local,
        )
        sources.append(src)
        offsets: list[int] = []
        pos = 0
        for numel, is_pad in zip(flat._numels_with_padding, flat._is_padding_mask):
            if not is_pad:
                offsets.append(pos)
            pos += numel
        contiguities = getattr(flat, "_contiguities", [True] * len(flat._shapes))
        primary: dict[tuple[int, str], int] = {}
        for i, info in enumerate(flat._param_infos):
            shape = torch.Size(flat._shapes[i])
            stride = tuple(flat._strides[i]) if not contiguities[i] else _contiguous_stride(shape)
            ref = _FlatRef(src, offsets[i], shape, stride, ("fsdp1", id(flat), i))
            refs[(id(info.module), info.param_name)] = ref
            primary[(id(info.module), info.param_name)] = i
        for sinfo in flat._shared_param_infos:
            prim = refs[(id(sinfo.prim_module), sinfo.prim_param_name)]
            refs[(id(sinfo.module), sinfo.param_name)] = prim
    return refs


def _fsdp2_param_records(model: nn.Module) -> list[object]:
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


def fsdp2_params(model: nn.Module) -> dict[tuple[int, str], object]:
    """(id(module), parameter name) -> its FSDPParam, tied registrations included.

    Keyed by FSDP's own records of where each parameter is registered, not by the
    tensor the module holds: after a forward under ``torch.no_grad()`` FSDP2 leaves
    the root's parameters unsharded, so the module then holds a plain full tensor,
    not the sharded DTensor (which the optimizer holds, and which is the truth).
    """
    out: dict[tuple[int, str], object] = {}
    for fp in _fsdp2_param_records(model):
        info = fp._module_info
        out[(id(info.module), info.param_name)] = fp
        for mod, name in zip(info.shared_modules, info.shared_param_names):
            out[(id(mod), name)] = fp
    return out


def fsdp2_optimizer_params(model: nn.Module) -> dict[int, object]:
    """id(sharded DTensor parameter, as the optimizer holds it) -> its FSDPParam."""
    return {id(fp.sharded_param): fp for fp in _fsdp2_param_records(model)}


def reshard_for_load(model: nn.Module) -> None:
    """Put every FSDP unit of ``model`` back into its sharded state before its shards
    are written. After a forward without backward (an evaluation under
    ``torch.no_grad()``) FSDP1 keeps the root's flat parameter unsharded and FSDP2
    the root's parameters; the next forward then uses that stale full copy instead
    of gathering the shards, so weights loaded into the shards would be silently
    ignored until the next backward. No collective: resharding only frees memory.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        FSDPModule = ()  # type: ignore[assignment,misc]
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()  # FSDP2's public API; a no-op when already sharded
    from torch.distributed.fsdp import _traversal_utils

    for handle in _traversal_utils._get_fsdp_handles(model):
        if not hasattr(handle.flat_param, "_full_param_padded"):
            continue  # not lazily initialised yet: nothing was ever unsharded
        if handle.uses_sharded_strategy and not handle.needs_unshard():
            handle.reshard(True)  # what FSDP1's own post-backward reshard does
            handle.post_reshard()
            handle._prefetched = False


def _fsdp2_source(fp, key: str, sources: list[Source]) -> Source:  # type: ignore[no-untyped-def]
    placement = getattr(fp, "fsdp_placement", None)
    if placement is not None and getattr(placement, "dim", 0) != 0:
        raise UnsupportedModelError(
            f"{key!r}: FSDP2 shards it on dim {placement.dim}; shardgather gathers dim-0 "
            "(Shard(0)) sharding only. Use the default shard placement for this parameter."
        )
    if getattr(fp, "is_dtensor", False):
        raise UnsupportedModelError(
            f"{key!r} is also sharded by tensor parallelism (a DTensor before fully_shard); "
            "shardgather gathers data-parallel (FSDP) sharding only."
        )
    mesh_info = fp.mesh_info
    group = getattr(mesh_info, "shard_process_group", None)
    world, rank, ranks = _group_info(group)
    if world == 1:
        group = None

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

    src = Source(
        index=len(sources),
        group=group,
        world=world,
        rank=rank,
        row_numel=int(math.prod(fp.padded_sharded_param_size)),
        dtype=fp.sharded_param.dtype,
        local=local,
        group_ranks=ranks,
        description=f"FSDP2 parameter {key}",
        storage=storage,
    )
    sources.append(src)
    return src


def _local_source(t: torch.Tensor, key: str, sources: list[Source]) -> Source:
    t = t.detach()
    dense = _is_dense(t)
    if not dense:
        t = t.contiguous()
    src = Source(
        index=len(sources),
        group=None,
        world=1,
        rank=0,
        row_numel=t.numel(),
        dtype=t.dtype,
        local=lambda t=t: memory_order_flat(t),
        description=f"local tensor {key}",
        storage=(lambda t=t: memory_order_flat(t)) if dense else None,
    )
    sources.append(src)
    return src


# --------------------------------------------------------------------------- the walk


def _walk(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
    """(clean prefix, module) in ``state_dict()`` order, wrappers skipped."""
    while (child := _wrapper_child_name(module)) is not None:
        module = getattr(module, child)
    yield prefix, module
    for name, child_module in module._modules.items():
        if child_module is None:
            continue
        yield from _walk(child_module, f"{prefix}{name}.")


def _is_flat_param(t: object) -> bool:
    from torch.distributed.fsdp._flat_param import FlatParameter

    return isinstance(t, FlatParameter)


def _orig_buffer_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """FSDP1 mixed precision casts buffers in place; state dicts report the original dtype."""
    from torch.distributed.fsdp import _traversal_utils

    from ._fqn import clean_fqn

    out: dict[str, torch.dtype] = {}
    for state in _traversal_utils._get_fsdp_states(model):
        for name, dtype in getattr(state, "_buffer_name_to_orig_dtype", {}).items():
            out[clean_fqn(name)] = dtype
    return out


def build_plan(model: nn.Module, *, dtype: torch.dtype | None = None) -> GatherPlan:
    """Walk ``model`` once and describe every key of its full state dict.

    Args:
        model: a plain, DDP-, compiled-, FSDP1- or FSDP2-wrapped module.
        dtype: cast floating-point entries to this dtype (None: keep).

    Raises:
        UnsupportedModelError: a parameter is sharded in a way shardgather cannot gather.
    """
    sources: list[Source] = []
    flat_refs = _fsdp1_refs(model, sources)
    fsdp2 = fsdp2_params(model)
    buffer_dtypes = _orig_buffer_dtypes(model) if flat_refs else {}
    flat_names: dict[int, list[str]] = {}
    for mod_id, name in flat_refs:
        flat_names.setdefault(mod_id, []).append(name)

    keys: list[str] = []
    entries: dict[str, Entry] = {}
    aliases: dict[str, str] = {}
    by_identity: dict[object, str] = {}
    fsdp2_sources: dict[int, Source] = {}

    def add(key: str, identity: object, make: Callable[[], Entry]) -> None:
        keys.append(key)
        if identity in by_identity:
            aliases[key] = by_identity[identity]
            return
        by_identity[identity] = key
        e = make()
        if dtype is not None and e.dtype.is_floating_point:
            e.out_dtype = dtype
        entries[key] = e

    for prefix, mod in _walk(model, ""):
        names = [n for n, p in mod._parameters.items() if p is not None and not _is_flat_param(p)]
        names += [n for n in flat_names.get(id(mod), []) if n not in names]
        for name in names:
            key = prefix + name
            ref = flat_refs.get((id(mod), name))
            if ref is not None:
                add(
                    key,
                    ref.identity,
                    lambda ref=ref, key=key: Entry(
                        key, ref.shape, ref.stride, ref.source.dtype, ref.source, ref.base
                    ),
                )
                continue
            p = mod._parameters[name]
            assert p is not None
            fp = fsdp2.get((id(mod), name))
            if fp is not None:

                def make2(fp=fp, key=key) -> Entry:
                    if id(fp) not in fsdp2_sources:
                        fsdp2_sources[id(fp)] = _fsdp2_source(fp, key, sources)
                    src = fsdp2_sources[id(fp)]
                    shape = torch.Size(fp._orig_size)
                    return Entry(key, shape, _contiguous_stride(shape), src.dtype, src, 0)

                add(key, ("fsdp2", id(fp)), make2)
                continue
            if _is_dtensor(p):
                raise UnsupportedModelError(
                    f"{key!r} is a DTensor not managed by fully_shard (tensor parallelism?); "
                    "shardgather gathers FSDP sharding only. Gather it with DTensor.full_tensor()."
                )
            add(key, ("local", id(p)), lambda p=p, key=key: _local_entry(key, p, sources))
        for name, b in mod._buffers.items():
            if b is None or name in mod._non_persistent_buffers_set:
                continue
            key = prefix + name

            def makeb(b=b, key=key) -> Entry:
                e = _local_entry(key, b, sources, is_buffer=True)
                orig = buffer_dtypes.get(key)
                if orig is not None and orig != e.dtype:
                    e.out_dtype = orig
                return e

            add(key, ("local", id(b)), makeb)

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    plan = GatherPlan(keys, entries, aliases, sources, rank, world, identities=by_identity)
    plan.fingerprint = fingerprint(plan)
    return plan


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def _local_entry(
    key: str, t: torch.Tensor, sources: list[Source], is_buffer: bool = False
) -> Entry:
    src = _local_source(t, key, sources)
    shape = t.shape
    stride = tuple(t.stride()) if _is_dense(t) else _contiguous_stride(shape)
    return Entry(key, shape, stride, t.dtype, src, 0, is_buffer=is_buffer)


def fingerprint(plan: GatherPlan) -> str:
    """A digest every rank must agree on before any collective runs."""
    import hashlib

    h = hashlib.sha256()
    for k in plan.keys:
        e = plan.entries.get(k)
        if e is None:
            h.update(f"{k}->{plan.aliases[k]};".encode())
        else:
            s = e.source
            h.update(
                f"{k}:{tuple(e.shape)}:{e.dtype}:{e.target_dtype}:{e.base}:{s.index}:"
                f"{s.world}:{s.row_numel}:{s.dtype}:{s.group is None};".encode()
            )
    return h.hexdigest()[:16]


def own_range(e: Entry, src: Source | None = None) -> tuple[int, int]:
    """This rank's elements of ``e`` (memory order) in its row of ``src`` (default: the
    entry's own source), or all of a local tensor."""
    src = src or e.source
    return elems_in_row(e.base, src.row_numel, e.numel, src.rank)


def flat_of(e: Entry, full: torch.Tensor) -> torch.Tensor:
    """``full`` in ``e``'s memory order, flattened."""
    t = full.detach()
    if not e.is_contiguous:
        t = torch.empty_strided(tuple(e.shape), e.stride, dtype=t.dtype, device=t.device).copy_(t)
    return memory_order_flat(t.contiguous() if e.is_contiguous else t)


def elems_in_row(base: int, p: int, numel: int, row: int) -> tuple[int, int]:
    lo = min(max(row * p - base, 0), numel)
    hi = min(max((row + 1) * p - base, 0), numel)
    return lo, max(lo, hi)
