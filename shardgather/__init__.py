"""shardgather: full, unwrapped state dicts from FSDP1/FSDP2 models, fast and memory-bounded.

How it is built: every verb runs one engine — a **plan** (what each key of the full
state dict is made of, from FSDP metadata: ``_plan``), a **transport** (how bytes move:
each rank writing its own pieces to their final place — node-local — or buckets
gathered through rank 0 — collective) and a **sink** (a host dict, files, a stream, or
the shards of a model being loaded): ``_engine``. Every call agrees, fails and times
out as one (``_dist``). The glossary of the words used throughout (source, entry,
piece, chunk, bucket, part, segment, slab) is in ``shardgather._plan.types``.
"""

from __future__ import annotations

from ._fqn import clean_fqn
from ._lib import build_info
from .errors import (
    BuildError,
    CheckpointError,
    CollectiveError,
    ShardGatherError,
    StateDictMismatchError,
    UnsupportedModelError,
)

__version__ = "0.1.0"

from ._dist import set_arrival_timeout
from ._engine.snapshot import AsyncSave
from ._options import Transport
from .adapters import adapter_keys, load_adapter, save_adapter
from .api import (
    LoadResult,
    full_optim_state_dict,
    full_state_dict,
    load_file,
    load_full_optim_state_dict,
    load_full_state_dict,
    release_staging,
    save_full_state_dict,
)
from .checkpoint import checkpoint_from_zero, load_checkpoint, save_checkpoint
from .stream import Gatherer, PackedBucket, iter_full_tensors
from .weight_sync import ConsumerError, WeightReceiver, WeightSender, connect_sync_group

__all__ = [
    "AsyncSave",
    "BuildError",
    "CheckpointError",
    "CollectiveError",
    "ConsumerError",
    "Gatherer",
    "LoadResult",
    "PackedBucket",
    "ShardGatherError",
    "StateDictMismatchError",
    "Transport",
    "UnsupportedModelError",
    "WeightReceiver",
    "WeightSender",
    "adapter_keys",
    "build_info",
    "checkpoint_from_zero",
    "clean_fqn",
    "connect_sync_group",
    "full_optim_state_dict",
    "full_state_dict",
    "iter_full_tensors",
    "load_adapter",
    "load_checkpoint",
    "load_file",
    "load_full_optim_state_dict",
    "load_full_state_dict",
    "release_staging",
    "save_adapter",
    "save_checkpoint",
    "save_full_state_dict",
    "set_arrival_timeout",
]
