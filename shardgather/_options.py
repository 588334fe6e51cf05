"""The options every verb takes, validated once (one dataclass), and the progress bar."""

from __future__ import annotations

import datetime
import enum
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .errors import ShardGatherError

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)

CPU_BUCKET_MB = 16
CUDA_BUCKET_MB = 256


class Transport(str, enum.Enum):
    """How bytes move between ranks. Valid for every verb:

    - ``"node-local"``: each rank moves its own bytes to their final place — writes its
      pieces into the shared output region or into the file (gather, save), reads its
      own elements from the file or its own dict (load). Ranks on other hosts than
      rank 0's send their pieces to rank 0.
    - ``"collective"``: through rank 0 — bucketed gathers to rank 0 (gather, save, the
      stream), or rank 0 sending every rank its elements (load: for a file only rank 0
      can read, or a dict only rank 0 holds).
    - ``"auto"``: node-local where it can run, else collective.
    """

    AUTO = "auto"
    NODE_LOCAL = "node-local"
    COLLECTIVE = "collective"


def transport_of(value: Any) -> Transport:
    if value == "shm":
        warnings.warn(
            'transport="shm" is now transport="node-local"', DeprecationWarning, stacklevel=4
        )
        return Transport.NODE_LOCAL
    try:
        return Transport(value)
    except ValueError:
        raise ShardGatherError(
            f"transport must be 'auto', 'node-local' or 'collective', got {value!r}"
        ) from None


@dataclass(frozen=True)
class Options:
    """One call's options (validated on construction).

    Attributes:
        dtype: cast floating-point entries to this dtype (None: keep).
        bucket_mb: MiB per bucket / message (None: 16 on CPU, 256 on CUDA).
        rank0_only: only global rank 0 receives (gathers).
        pin_memory: outputs in pinned host memory (CUDA).
        progress: one tqdm bar on rank 0 counting every rank's bytes (``_progress``).
        timeout: the longest any wait of the call may last.
        transport: see :class:`Transport`.
        shared_filesystem: every host sees the output path (saves: every rank writes).
        strict: loads: missing or unexpected keys are an error.
        in_flight: saves: what to do while an earlier ``blocking=False`` save of the
            model is pending (``"wait"``: finish it first; ``"error"``: raise).
        max_snapshot_mb: async saves: at most this much staging (None: no cap).
        write_mb_per_s: async saves: the background writer's pace (None: the disk's).
    """

    dtype: torch.dtype | None = None
    bucket_mb: float | None = None
    rank0_only: bool = True
    pin_memory: bool = False
    progress: bool = False
    timeout: datetime.timedelta = DEFAULT_TIMEOUT
    transport: Transport = Transport.AUTO
    shared_filesystem: bool = False
    strict: bool = True
    in_flight: str = "wait"
    max_snapshot_mb: float | None = None
    write_mb_per_s: float | None = None

    def __post_init__(self) -> None:
        if self.bucket_mb is not None and not (
            isinstance(self.bucket_mb, (int, float)) and self.bucket_mb > 0
        ):
            raise ShardGatherError(f"bucket_mb must be > 0, got {self.bucket_mb}")
        if self.dtype is not None and not (
            isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point
        ):
            raise ShardGatherError(
                f"dtype must be a floating-point torch.dtype or None, got {self.dtype}"
            )
        if not isinstance(self.timeout, datetime.timedelta) or self.timeout.total_seconds() <= 0:
            raise ShardGatherError(
                f"timeout must be a positive datetime.timedelta, got {self.timeout!r}"
            )
        object.__setattr__(self, "transport", transport_of(self.transport))
        if self.in_flight not in ("wait", "error"):
            raise ShardGatherError(f"in_flight must be 'wait' or 'error', got {self.in_flight!r}")
        if self.max_snapshot_mb is not None and not (
            isinstance(self.max_snapshot_mb, (int, float)) and self.max_snapshot_mb >= 0
        ):
            raise ShardGatherError(f"max_snapshot_mb must be >= 0, got {self.max_snapshot_mb}")
        if self.write_mb_per_s is not None and not (
            isinstance(self.write_mb_per_s, (int, float)) and self.write_mb_per_s > 0
        ):
            raise ShardGatherError(f"write_mb_per_s must be > 0, got {self.write_mb_per_s}")
        for name in ("rank0_only", "pin_memory", "progress", "shared_filesystem", "strict"):
            if not isinstance(getattr(self, name), bool):
                raise ShardGatherError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.pin_memory and not torch.cuda.is_available():
            raise ShardGatherError(
                "pin_memory=True needs CUDA (pinned memory is page-locked for DMA)"
            )

    @property
    def snapshot_cap(self) -> int | None:
        """Bytes of staging an async save may take (None: no cap)."""
        return None if self.max_snapshot_mb is None else int(self.max_snapshot_mb * 2**20)

    @property
    def write_rate(self) -> float | None:
        """Bytes per second the background writer may write (None: the disk's pace)."""
        return None if self.write_mb_per_s is None else self.write_mb_per_s * 2**20

    def bucket_bytes(self, on_cuda: bool) -> int:
        mb = (
            self.bucket_mb
            if self.bucket_mb is not None
            else (CUDA_BUCKET_MB if on_cuda else CPU_BUCKET_MB)
        )
        return int(mb * 2**20)


def check_model(model: Any) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise ShardGatherError(
            f"expected an nn.Module (plain, DDP, torch.compile'd, FSDP1 or FSDP2), got "
            f"{type(model).__name__}"
        )
    return model
