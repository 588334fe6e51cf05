"""FSDP1 (``FullyShardedDataParallel``) internals: where each original parameter lives
in its flat parameter's shard, and the buffers' original dtypes under mixed precision."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .types import Source, contiguous_stride, group_info


@dataclass
class FlatRef:
    source: Source
    base: int
    shape: torch.Size
    stride: tuple[int, ...]
    identity: tuple[str, int, int]  # ("fsdp1", id(flat_param), param index): aliases share it
    requires_grad: bool = False


def flat_refs(model: nn.Module, sources: list[Source]) -> dict[tuple[int, str], FlatRef]:
    """(id(module), param name) -> where the param lives in its FSDP1 flat parameter."""
    from torch.distributed.fsdp import _traversal_utils

    refs: dict[tuple[int, str], FlatRef] = {}
    for handle in _traversal_utils._get_fsdp_handles(model):
        flat = handle.flat_param
        sharded = bool(getattr(handle, "uses_sharded_strategy", True))
        group = handle.process_group if sharded else None
        world, rank, ranks = group_info(group)
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
            device=flat.device,
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
        # use_orig_params=True keeps the original parameters (each its own requires_grad:
        # a frozen base and a trainable adapter may share a flat parameter); otherwise
        # FSDP1 requires one requires_grad per flat parameter.
        origs = getattr(flat, "_params", None)
        for i, info in enumerate(flat._param_infos):
            shape = torch.Size(flat._shapes[i])
            stride = tuple(flat._strides[i]) if not contiguities[i] else contiguous_stride(shape)
            grad = bool(origs[i].requires_grad if origs is not None else flat.requires_grad)
            ref = FlatRef(src, offsets[i], shape, stride, ("fsdp1", id(flat), i), grad)
            refs[(id(info.module), info.param_name)] = ref
            primary[(id(info.module), info.param_name)] = i
        for sinfo in flat._shared_param_infos:
            prim = refs[(id(sinfo.prim_module), sinfo.prim_param_name)]
            refs[(id(sinfo.module), sinfo.param_name)] = prim
    return refs


def orig_buffer_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """FSDP1 mixed precision casts buffers in place; state dicts report the original dtype."""
    from torch.distributed.fsdp import _traversal_utils

    from .._fqn import clean_fqn

    out: dict[str, torch.dtype] = {}
    for state in _traversal_utils._get_fsdp_states(model):
        for name, dtype in getattr(state, "_buffer_name_to_orig_dtype", {}).items():
            out[clean_fqn(name)] = dtype
    return out


def reshard(model: nn.Module) -> None:
    """Reshard every FSDP1 handle left unsharded (see :func:`shardgather._plan.reshard_for_load`)."""
    from torch.distributed.fsdp import _traversal_utils

    for handle in _traversal_utils._get_fsdp_handles(model):
        if not hasattr(handle.flat_param, "_full_param_padded"):
            continue  # not lazily initialised yet: nothing was ever unsharded
        if handle.uses_sharded_strategy and not handle.needs_unshard():
            handle.reshard(True)  # what FSDP1's own post-backward reshard does
            handle.post_reshard()
            handle._prefetched = False


def handles(model: nn.Module) -> list:  # type: ignore[type-arg]
    """Every FSDP1 flat-parameter handle under ``model``."""
    from torch.distributed.fsdp import _traversal_utils

    return list(_traversal_utils._get_fsdp_handles(model))


def is_flat_param(t: object) -> bool:
    from torch.distributed.fsdp._flat_param import FlatParameter

    return isinstance(t, FlatParameter)
