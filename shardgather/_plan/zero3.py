"""DeepSpeed ZeRO-3 parameters (read through a ``DeepSpeedEngine`` or its module).

ZeRO-3 leaves each parameter's ``data`` empty between uses; every rank of the
parameter's group holds ``ds_tensor``, its slice of the flattened elements: row R is
elements ``[R * P, (R + 1) * P)`` with ``P = ceil(numel / world)``, the last row
padded. That is exactly a source of one entry at base 0 (an FSDP1 flat parameter that
holds a single tensor), so the engine gathers, saves (each rank pwriting its own
slice) and streams it like any other — no module-by-module gather onto rank 0.

Values are what the module holds (its compute dtype: the 16-bit weights under mixed
precision, as DeepSpeed's ``stage3_gather_16bit_weights_on_model_save``); the fp32
masters live in the optimizer's partitions — save a checkpoint and convert it
(``shardgather consolidate``) for those. Attributes are feature-detected.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..errors import UnsupportedModelError
from .types import Source, group_info


def is_partitioned(p: Any) -> bool:
    return hasattr(p, "ds_tensor") and hasattr(p, "ds_shape") and hasattr(p, "ds_numel")


def source_of(p: Any, key: str, sources: list[Source]) -> Source:
    group = getattr(p, "ds_process_group", None) or dist.group.WORLD
    world, rank, ranks = group_info(group)
    row = p.ds_tensor
    numel = int(p.ds_numel)
    if row.numel() * world < numel or (numel and row.numel() == 0):
        raise UnsupportedModelError(
            f"{key!r}: its ZeRO-3 partition holds {row.numel()} elements on a group of "
            f"{world} for {numel} (offloaded to NVMe?); gather it with "
            "deepspeed.zero.GatheredParameters or save a checkpoint and convert it"
        )

    def local(p: Any = p) -> torch.Tensor:
        return p.ds_tensor.detach().reshape(-1)

    src = Source(
        index=len(sources),
        group=group,
        world=world,
        rank=rank,
        row_numel=row.numel(),
        dtype=row.dtype,
        local=local,
        group_ranks=ranks,
        description=f"ZeRO-3 partition of {key}",
        storage=None,  # see refuse_load
        device=row.device,
    )
    sources.append(src)
    return src


def shape_of(p: Any) -> torch.Size:
    return torch.Size(tuple(p.ds_shape))


def refuse_load(model: torch.nn.Module) -> None:
    """Loading into ZeRO-3 partitions would be undone: the optimizer steps its own fp32
    copies and writes them back over ``ds_tensor``."""
    for name, p in model.named_parameters():
        if is_partitioned(p):
            raise UnsupportedModelError(
                f"{name!r} is a DeepSpeed ZeRO-3 partition: weights loaded into it would be "
                "overwritten by the optimizer's fp32 copy at the next step. Load into the "
                "model before deepspeed.initialize (each rank still reads only what it "
                "needs), or resume with engine.load_checkpoint."
            )
