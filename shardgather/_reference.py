"""Pure-torch copy_out / copy_in: the test oracle and the fallback when the compiled
library is missing. Element-wise gathers through the layout rule: slow but obviously
right, and independent of the C++ run splitting.
"""

from __future__ import annotations

import torch

from . import _layout as L


def _shard_addresses(seg: torch.Tensor, first_row: int, rows: int, row_bytes: int):
    """Element indices (within the segment) present in the rows, their byte addresses,
    and their element offsets on the full side."""
    s = L.Segment(*(int(v) for v in seg))
    shard_size = L.KIND_SIZE[s.shard_kind]
    e = torch.arange(s.numel, dtype=torch.int64)
    if s.numel == 0:
        return e, e, e
    run = s.block.run_numel
    ss, fs = s.block.strides
    flat = s.base + (e // run) * ss + e % run
    row = flat // s.row_numel
    keep = (row >= first_row) & (row < first_row + rows)
    addr = (row - first_row) * row_bytes + s.col_byte + (flat % s.row_numel) * shard_size
    full = (e // run) * fs + e % run
    return e[keep], addr[keep], full[keep]


def _as_kind(raw: torch.Tensor, kind: int) -> torch.Tensor:
    """View ``[n, size]`` uint8 as elements of ``kind`` (1-D)."""
    if L.is_float_kind(kind):
        return raw.contiguous().view(L.KIND_DTYPE[kind]).view(-1)
    return raw  # raw kinds stay bytes


def _to_bytes(x: torch.Tensor, kind: int) -> torch.Tensor:
    if L.is_float_kind(kind):
        return x.contiguous().view(torch.uint8).view(-1, L.KIND_SIZE[kind])
    return x


def _convert(x: torch.Tensor, src_kind: int, dst_kind: int) -> torch.Tensor:
    if src_kind == dst_kind:
        return x
    return x.to(L.KIND_DTYPE[dst_kind])


def copy_out(
    shards: torch.Tensor, first_row: int, segments: torch.Tensor, fulls: list[torch.Tensor]
) -> None:
    """Reference of ``torch.ops.shardgather.copy_out`` (same arguments and effect)."""
    rows, row_bytes = shards.shape
    flat_shards = shards.reshape(-1)
    for seg in segments:
        e, addr, at = _shard_addresses(seg, first_row, rows, row_bytes)
        if e.numel() == 0:
            continue
        sk, fk = int(seg[L.SHARD_KIND]), int(seg[L.FULL_KIND])
        ssize, fsize = L.KIND_SIZE[sk], L.KIND_SIZE[fk]
        raw = flat_shards[addr[:, None] + torch.arange(ssize)]
        vals = _to_bytes(_convert(_as_kind(raw, sk), sk, fk), fk)
        full = fulls[int(seg[L.FULL_INDEX])].reshape(-1).view(torch.uint8)
        dst = int(seg[L.FULL_BYTE]) + at[:, None] * fsize + torch.arange(fsize)
        full[dst.reshape(-1)] = vals.reshape(-1).to(full.device)


def copy_in(
    fulls: list[torch.Tensor], segments: torch.Tensor, shards: torch.Tensor, first_row: int
) -> None:
    """Reference of ``torch.ops.shardgather.copy_in`` (same arguments and effect)."""
    rows, row_bytes = shards.shape
    flat_shards = shards.view(-1)
    for seg in segments:
        e, addr, at = _shard_addresses(seg, first_row, rows, row_bytes)
        if e.numel() == 0:
            continue
        sk, fk = int(seg[L.SHARD_KIND]), int(seg[L.FULL_KIND])
        ssize, fsize = L.KIND_SIZE[sk], L.KIND_SIZE[fk]
        full = fulls[int(seg[L.FULL_INDEX])].reshape(-1).view(torch.uint8)
        src = int(seg[L.FULL_BYTE]) + at[:, None] * fsize + torch.arange(fsize)
        raw = full[src.reshape(-1)].view(-1, fsize).to(shards.device)
        vals = _to_bytes(_convert(_as_kind(raw, fk), fk, sk), sk)
        flat_shards[(addr[:, None] + torch.arange(ssize)).reshape(-1)] = vals.reshape(-1)


def diff_update(
    src: torch.Tensor,
    ref: torch.Tensor,
    positions: torch.Tensor,
    values: torch.Tensor,
    count: torch.Tensor,
    base: int,
) -> None:
    """What ``shardgather::diff_update`` computes, in plain torch."""
    bits = {2: torch.int16, 4: torch.int32}[ref.element_size()]
    cur = src.to(ref.dtype)
    idx = torch.nonzero(cur.view(bits) != ref.view(bits)).reshape(-1)
    ref[idx] = cur[idx]
    m = min(idx.numel(), positions.numel())
    positions[:m] = (idx[:m] + base).to(positions.dtype)
    values[:m] = cur[idx[:m]]
    count[0] = idx.numel()
