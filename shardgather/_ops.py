"""Typed wrappers of the compiled ops (or of the reference, when falling back).

Both ops mutate their outputs in place and return nothing. On CUDA they are
asynchronous on the current stream, also when they write pinned host memory:
synchronise before reading the host tensors.
"""

from __future__ import annotations

import torch

from . import _lib, _reference


def copy_out(
    shards: torch.Tensor, first_row: int, segments: torch.Tensor, fulls: list[torch.Tensor]
) -> None:
    """Copy (and cast) every segment from rank-major shards into the full tensors.

    Args:
        shards: uint8 ``[rows, row_bytes]``, contiguous: rows ``first_row ..`` of the
            gathered layout (a whole gathered bucket: ``first_row=0``).
        first_row: the global row index of ``shards[0]``.
        segments: int64 ``[S, 11]`` CPU table (see ``shardgather._layout``).
        fulls: contiguous destinations addressed by the table (CUDA shards: CUDA or
            pinned CPU tensors).
    """
    if _lib.require_compiled():
        torch.ops.shardgather.copy_out(shards, first_row, segments, fulls)
    else:
        _reference.copy_out(shards, first_row, segments, fulls)


def copy_in(
    fulls: list[torch.Tensor], segments: torch.Tensor, shards: torch.Tensor, first_row: int
) -> None:
    """Inverse of :func:`copy_out`: write the full tensors' elements into the shards
    (rows outside ``shards`` are skipped; padding is never written)."""
    if _lib.require_compiled():
        torch.ops.shardgather.copy_in(fulls, segments, shards, first_row)
    else:
        _reference.copy_in(fulls, segments, shards, first_row)


def diff_update(
    src: torch.Tensor,
    ref: torch.Tensor,
    positions: torch.Tensor,
    values: torch.Tensor,
    base: int,
) -> int:
    """The weight-sync delta of one chunk: ``src`` cast to ``ref``'s dtype, compared
    bitwise with ``ref``; differing elements are written into ``ref`` and the first
    ``positions.numel()`` of them recorded (``base + index``, new value). Returns how
    many differed."""
    count = torch.zeros(1, dtype=torch.int64)
    if _lib.require_compiled():
        torch.ops.shardgather.diff_update(src, ref, positions, values, count, base)
    else:
        _reference.diff_update(src, ref, positions, values, count, base)
    return int(count[0])


def _register_fakes() -> None:
    # Out-variant ops return nothing: their fake (meta) kernels only need to exist,
    # so the ops trace under torch.compile / FakeTensor (checked by opcheck).
    if not _lib.compiled_available():
        return

    @torch.library.register_fake("shardgather::copy_out")
    def _copy_out_fake(shards, first_row, segments, fulls):  # type: ignore[no-untyped-def]
        return None

    @torch.library.register_fake("shardgather::copy_in")
    def _copy_in_fake(fulls, segments, shards, first_row):  # type: ignore[no-untyped-def]
        return None

    @torch.library.register_fake("shardgather::diff_update")
    def _diff_update_fake(src, ref, positions, values, count, base):  # type: ignore[no-untyped-def]
        return None


_register_fakes()
