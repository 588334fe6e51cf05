"""The gather plan: what every output key is made of, built from FSDP metadata alone.

This package is the only code that reads FSDP internals (``fsdp1``, ``fsdp2``,
``optim``). No collective runs here, so the plan is identical on every rank and
testable from metadata. See :mod:`shardgather._plan.types` for the glossary.
"""

from .._layout import Block
from .types import (
    Entry,
    GatherPlan,
    Source,
    blocks_of,
    contiguous_stride,
    fingerprint,
    flat_of,
    group_info,
    memory_order_flat,
    own_blocks,
    row_blocks,
    row_of_rank,
)
from .walk import build_plan, reshard_for_load
from .wrappers import unwrap, wrapper_child_name

__all__ = [
    "Block",
    "Entry",
    "GatherPlan",
    "Source",
    "build_plan",
    "blocks_of",
    "contiguous_stride",
    "fingerprint",
    "flat_of",
    "group_info",
    "memory_order_flat",
    "own_blocks",
    "reshard_for_load",
    "row_blocks",
    "row_of_rank",
    "unwrap",
    "wrapper_child_name",
]
