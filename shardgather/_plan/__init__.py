"""The gather plan: what every output key is made of, built from FSDP metadata alone.

This package is the only code that reads FSDP internals (``fsdp1``, ``fsdp2``,
``optim``). No collective runs here, so the plan is identical on every rank and
testable from metadata. See :mod:`shardgather._plan.types` for the glossary.
"""

from .types import (
    Entry,
    GatherPlan,
    Source,
    contiguous_stride,
    elems_in_row,
    fingerprint,
    flat_of,
    group_info,
    memory_order_flat,
    own_range,
    row_of_rank,
)
from .walk import build_plan, reshard_for_load
from .wrappers import unwrap, wrapper_child_name

__all__ = [
    "Entry",
    "GatherPlan",
    "Source",
    "build_plan",
    "contiguous_stride",
    "elems_in_row",
    "fingerprint",
    "flat_of",
    "group_info",
    "memory_order_flat",
    "own_range",
    "reshard_for_load",
    "row_of_rank",
    "unwrap",
    "wrapper_child_name",
]
