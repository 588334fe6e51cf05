"""shardgather: full, unwrapped state dicts from FSDP1/FSDP2 models, fast and memory-bounded."""

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

__all__ = [
    "BuildError",
    "CheckpointError",
    "CollectiveError",
    "ShardGatherError",
    "StateDictMismatchError",
    "UnsupportedModelError",
    "build_info",
    "clean_fqn",
]
__version__ = "0.1.0"

from .api import full_state_dict

__all__ += ["full_state_dict"]

from .checkpoint import LoadResult, load_file, load_full_state_dict, save_full_state_dict  # noqa: E402

__all__ += ["LoadResult", "load_file", "load_full_state_dict", "save_full_state_dict"]

from .optim import full_optim_state_dict, load_full_optim_state_dict  # noqa: E402

__all__ += ["full_optim_state_dict", "load_full_optim_state_dict"]

from .resume import load_checkpoint, save_checkpoint  # noqa: E402

__all__ += ["load_checkpoint", "save_checkpoint"]

from .stream import Gatherer, iter_full_tensors  # noqa: E402

__all__ += ["Gatherer", "iter_full_tensors"]
