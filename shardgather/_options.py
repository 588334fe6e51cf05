"""Call options shared by every verb: defaults, validation, the progress bar."""

from __future__ import annotations

import datetime
from typing import Any

import torch
from torch import nn

from ._plan import GatherPlan
from .errors import ShardGatherError

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


CPU_BUCKET_MB = 16
CUDA_BUCKET_MB = 256


def default_bucket_mb(plan: GatherPlan) -> float:
    """16 MiB when every gathered source lives on the CPU, else 256 MiB."""
    on_cuda = any(s.group is not None and s.local().is_cuda for s in plan.sources)
    return CUDA_BUCKET_MB if on_cuda else CPU_BUCKET_MB


def verify_options(model: Any, bucket_mb: float | None, dtype: torch.dtype | None) -> None:
    if not isinstance(model, nn.Module):
        raise ShardGatherError(
            f"expected an nn.Module (plain, DDP, torch.compile'd, FSDP1 or FSDP2), got "
            f"{type(model).__name__}"
        )
    if bucket_mb is not None and not bucket_mb > 0:
        raise ShardGatherError(f"bucket_mb must be > 0, got {bucket_mb}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ShardGatherError(f"dtype must be a floating-point torch.dtype or None, got {dtype}")


TRANSPORTS = ("auto", "node-local", "collective")


def verify_transport(transport: str, pin_memory: bool) -> None:
    """``"node-local"``: each rank writes its own pieces to their final place (a shared
    region or the file), required (warns once and falls back when impossible);
    ``"collective"``: bucketed gathers to rank 0; ``"auto"``: node-local when possible.
    ``"shm"`` is the old name of ``"node-local"`` (deprecated: it also meant "pwrite into
    the file" for saves)."""
    if transport == "shm":
        import warnings

        warnings.warn(
            'transport="shm" is now transport="node-local"', DeprecationWarning, stacklevel=3
        )
    elif transport not in TRANSPORTS:
        raise ShardGatherError(
            f"transport must be 'auto', 'node-local' or 'collective', got {transport!r}"
        )
    if pin_memory and not torch.cuda.is_available():
        raise ShardGatherError("pin_memory=True needs CUDA (pinned memory is page-locked for DMA)")


class Progress:
    def __init__(self, enabled: bool, total: int, desc: str) -> None:
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
