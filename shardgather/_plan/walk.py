"""The walk: the model's modules in ``state_dict()`` order, wrappers skipped, each
parameter and persistent buffer becoming an entry (FSDP1, FSDP2 or local)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from . import dtensor, fsdp1, fsdp2, zero3
from .subset import KeySelection, select
from .types import (
    Entry,
    GatherPlan,
    Source,
    contiguous_stride,
    fingerprint,
    is_dense,
    memory_order_flat,
)
from .wrappers import wrapper_child_name


def _local_source(t: torch.Tensor, key: str, sources: list[Source]) -> Source:
    t = t.detach()
    dense = is_dense(t)
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
        device=t.device,
    )
    sources.append(src)
    return src


def _walk(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
    """(clean prefix, module) in ``state_dict()`` order, wrappers skipped."""
    while (child := wrapper_child_name(module)) is not None:
        module = getattr(module, child)
    yield prefix, module
    for name, child_module in module._modules.items():
        if child_module is None:
            continue
        yield from _walk(child_module, f"{prefix}{name}.")


def walk_modules(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(clean key prefix, module) for every module, wrappers skipped, in ``state_dict()``
    order — the names every verb uses."""
    return _walk(module, "")


def build_plan(
    model: nn.Module, *, dtype: torch.dtype | None = None, keys: KeySelection | None = None
) -> GatherPlan:
    """Walk ``model`` once and describe every key of its full state dict.

    Args:
        model: a plain, DDP-, compiled-, FSDP1- or FSDP2-wrapped module.
        dtype: cast floating-point entries to this dtype (None: keep).
        keys: only these keys (see :mod:`shardgather._plan.subset`; None: all).

    Raises:
        UnsupportedModelError: a parameter is sharded in a way shardgather cannot gather.
    """
    sources: list[Source] = []
    flat_refs = fsdp1.flat_refs(model, sources)
    fsdp2_params = fsdp2.params_by_module(model)
    buffer_dtypes = fsdp1.orig_buffer_dtypes(model) if flat_refs else {}
    flat_names: dict[int, list[str]] = {}
    for mod_id, name in flat_refs:
        flat_names.setdefault(mod_id, []).append(name)

    order: list[str] = []  # every key, state_dict() order
    entries: dict[str, Entry] = {}
    aliases: dict[str, str] = {}
    by_identity: dict[object, str] = {}

    def add(key: str, identity: object, make: Callable[[], Entry], trainable: bool) -> None:
        order.append(key)
        if identity in by_identity:
            aliases[key] = by_identity[identity]
            return
        by_identity[identity] = key
        e = make()
        e.trainable = trainable
        if dtype is not None and e.dtype.is_floating_point:
            e.out_dtype = dtype
        entries[key] = e

    hooked: list[str] = []
    for prefix, mod in _walk(model, ""):
        if _foreign_hooks(mod):
            hooked.append(prefix.rstrip(".") or "<root>")
        names = [
            n for n, p in mod._parameters.items() if p is not None and not fsdp1.is_flat_param(p)
        ]
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
                    ref.requires_grad,
                )
                continue
            p = mod._parameters[name]
            assert p is not None
            if zero3.is_partitioned(p):

                def make3(p=p, key=key) -> Entry:
                    shape = zero3.shape_of(p)
                    src = zero3.source_of(p, key, sources)
                    return Entry(key, shape, contiguous_stride(shape), src.dtype, src, 0)

                add(key, ("zero3", id(p)), make3, bool(p.requires_grad))
                continue
            fp = fsdp2_params.get((id(mod), name))
            if fp is not None:

                def make2(fp=fp, key=key) -> Entry:
                    src, blocks = fsdp2.source_of(fp, key, sources)
                    shape = torch.Size(fp.sharded_param.shape)
                    return Entry(
                        key, shape, contiguous_stride(shape), src.dtype, src, 0, blocks=blocks
                    )

                add(key, ("fsdp2", id(fp)), make2, bool(fp.sharded_param.requires_grad))
                continue
            make = lambda p=p, key=key: _tensor_entry(key, p, sources)  # noqa: E731
            add(key, ("local", id(p)), make, p.requires_grad)
        for name, b in mod._buffers.items():
            if b is None or name in mod._non_persistent_buffers_set:
                continue
            key = prefix + name

            def makeb(b=b, key=key) -> Entry:
                e = _tensor_entry(key, b, sources, is_buffer=True)
                orig = buffer_dtypes.get(key)
                if orig is not None and orig != e.dtype:
                    e.out_dtype = orig
                return e

            add(key, ("local", id(b)), makeb, False)

    if hooked:
        _warn_state_dict_hooks(hooked)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    plan = GatherPlan(order, entries, aliases, sources, rank, world, identities=by_identity)
    plan.fingerprint = fingerprint(plan)
    return select(plan, keys)


_WARNED_HOOKS: set[tuple[str, ...]] = set()


def _foreign_hooks(mod: nn.Module) -> bool:
    """State-dict hooks not torch.distributed's own (FSDP2 adds a resharding pre-hook to
    every module it wraps; it changes no name or value)."""
    hooks = [*mod._state_dict_hooks.values(), *mod._state_dict_pre_hooks.values()]
    return any(
        not (getattr(h, "__module__", None) or "").startswith("torch.distributed.") for h in hooks
    )


def _warn_state_dict_hooks(prefixes: list[str]) -> None:
    """A module's own ``state_dict`` hooks may rename or transform what it saves (torchtitan's
    fused QKV splits ``wqkv`` into ``wq``/``wk``/``wv``). shardgather names tensors as the
    parameters are registered and never runs those hooks: say so once per model layout rather
    than let the two dicts differ silently."""
    key = tuple(prefixes)
    if key in _WARNED_HOOKS:
        return
    _WARNED_HOOKS.add(key)
    shown = ", ".join(repr(p) for p in prefixes[:3]) + (" ..." if len(prefixes) > 3 else "")
    warnings.warn(
        f"{len(prefixes)} module(s) register state_dict hooks ({shown}); shardgather names "
        "each tensor as the module registers it and does not run those hooks, so its keys "
        "or values can differ from model.state_dict(). Rename with key_map=, or build the "
        "model without the hooked modules (e.g. torchtitan fuse_qkv=False).",
        UserWarning,
        stacklevel=3,
    )


def _tensor_entry(
    key: str, t: torch.Tensor, sources: list[Source], is_buffer: bool = False
) -> Entry:
    """A parameter or buffer FSDP does not manage: a DTensor (tensor/expert parallel,
    ``replicate``) by its placements, any other tensor held whole by every rank."""
    if dtensor.is_dtensor(t):

        def row(t=t) -> torch.Tensor:
            return t.to_local().detach().reshape(-1)  # type: ignore[attr-defined]

        # Replicated on every mesh dim: a source of no group, held whole.
        src, blocks = dtensor.source_of(key, t, sources, local=row, storage=row)
        shape = torch.Size(t.shape)
        return Entry(
            key, shape, contiguous_stride(shape), t.dtype, src, 0, is_buffer, blocks=blocks
        )
    return _local_entry(key, t, sources, is_buffer=is_buffer)


def _local_entry(
    key: str, t: torch.Tensor, sources: list[Source], is_buffer: bool = False
) -> Entry:
    src = _local_source(t, key, sources)
    shape = t.shape
    stride = tuple(t.stride()) if is_dense(t) else contiguous_stride(shape)
    return Entry(key, shape, stride, t.dtype, src, 0, is_buffer=is_buffer)


def reshard_for_load(model: nn.Module) -> None:
    """Put every FSDP unit of ``model`` back into its sharded state before its shards
    are written. After a forward without backward (an evaluation under
    ``torch.no_grad()``) FSDP1 keeps the root's flat parameter unsharded and FSDP2
    the root's parameters; the next forward then uses that stale full copy instead
    of gathering the shards, so weights loaded into the shards would be silently
    ignored until the next backward. No collective: resharding only frees memory.
    """
    zero3.refuse_load(model)
    fsdp2.reshard(model)
    fsdp1.reshard(model)
