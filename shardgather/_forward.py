"""Pieces held by ranks on other hosts travel to rank 0 point to point.

With the node-local transport every rank on rank 0's host writes its own pieces
straight to their final place; a rank elsewhere cannot reach that /dev/shm region
or that file. It packs its pieces (already cast to the output dtype, so a bf16
export moves half the bytes) into messages of at most ``message_bytes`` and sends
them to rank 0, which writes each part where it belongs. Both sides derive the
same message layout from the plan, so only payload crosses the wire, and two
buffers per side keep packing, sending and writing overlapped.

A failure while packing or writing does not stop the exchange (the peer would hang
until the timeout): the rank keeps sending/receiving and reports the error, which
the caller's final agreement turns into an error on every rank.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._collectives import p2p_device, wait_or_raise
from ._pieces import Piece, cast_into, local_chunk
from ._plan import Entry
from .io.safetensors_format import pwrite_from

_ALIGN = 16
# Bytes this process sent to / received from other hosts (cumulative; tests and
# benchmarks read the difference around a call).
STATS = {"sent": 0, "received": 0}


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass
class Part:
    """``numel`` elements of a piece, from element ``start`` of the piece, at byte
    ``offset`` of a message."""

    piece: Piece
    start: int
    numel: int
    offset: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.piece.entry.target_dtype.itemsize


def messages(pieces: list[Piece], message_bytes: int) -> list[list[Part]]:
    """Pack pieces in order into messages of at most ``message_bytes`` (parts 16-byte
    aligned; a piece larger than a message is split)."""
    cap = max(message_bytes, 4 * _ALIGN)
    out: list[list[Part]] = []
    cur: list[Part] = []
    used = 0
    for pc in pieces:
        size = pc.entry.target_dtype.itemsize
        a = 0
        while a < pc.numel:
            room = (cap - _align(used)) // size
            if room <= 0:
                out.append(cur)
                cur, used = [], 0
                continue
            n = min(room, pc.numel - a)
            cur.append(Part(pc, a, n, _align(used)))
            used = _align(used) + n * size
            a += n
    if cur:
        out.append(cur)
    return out


def message_size(parts: list[Part]) -> int:
    return parts[-1].offset + parts[-1].nbytes


def _chunk(part: Part, rows: dict[int, torch.Tensor]) -> torch.Tensor:
    return local_chunk(part.piece, rows)[part.start : part.start + part.numel]


def _pack(parts: list[Part], buf: torch.Tensor, rows: dict[int, torch.Tensor]) -> torch.Tensor:
    """The message for ``parts``: the local shard itself when it is one same-dtype part
    (nothing to copy), else packed (and cast) into ``buf``."""
    if len(parts) == 1:
        chunk = _chunk(parts[0], rows)
        same = parts[0].piece.entry.target_dtype == chunk.dtype
        if same and chunk.device == buf.device and chunk.is_contiguous():
            return chunk.view(torch.uint8)
    for p in parts:
        out = buf[p.offset : p.offset + p.nbytes]
        chunk = _chunk(p, rows)
        if chunk.device.type == "cpu" and out.device.type == "cpu":
            cast_into(chunk, p.piece.entry.target_dtype, out)
        else:
            out.view(p.piece.entry.target_dtype).copy_(chunk)
    return buf[: message_size(parts)]


def send_pieces(pieces: list[Piece], message_bytes: int, timeout: datetime.timedelta) -> str:
    """Send this rank's pieces to rank 0. Returns "" or what failed while packing (the
    messages still go out, so rank 0 does not hang)."""
    device = p2p_device()
    msgs = messages(pieces, message_bytes)
    bufs = [torch.empty(0, dtype=torch.uint8, device=device) for _ in range(2)]
    pending: list = [None, None]
    rows: dict[int, torch.Tensor] = {}
    error = ""
    for i, parts in enumerate(msgs):
        slot = i % 2
        if pending[slot] is not None:
            wait_or_raise(pending[slot], timeout, f"sending message {i - 2} to rank 0")
        size = message_size(parts)
        if bufs[slot].numel() < size:
            bufs[slot] = torch.empty(size, dtype=torch.uint8, device=device)
        try:
            payload = _pack(parts, bufs[slot], rows) if not error else bufs[slot][:size]
        except Exception as exc:
            error = f"packing pieces for rank 0: {type(exc).__name__}: {exc}"
            payload = bufs[slot][:size]
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        pending[slot] = dist.isend(payload, dst=0, tag=i)
        STATS["sent"] += size
    for work in pending:
        if work is not None:
            wait_or_raise(work, timeout, "sending the last messages to rank 0")
    return error


def receive_pieces(
    sender: int,
    pieces: list[Piece],
    message_bytes: int,
    fd_of: Callable[[Entry], int],
    offset_of: Callable[[Entry], int],
    timeout: datetime.timedelta,
    buffers: dict[str, list[torch.Tensor]],
) -> str:
    """Rank 0: receive ``sender``'s pieces and pwrite each part at its final offset.
    ``buffers`` (start with ``{}``) carries the two receive buffers from one sender to
    the next. Returns "" or what failed while writing (receiving goes on regardless)."""
    device = p2p_device()
    msgs = messages(pieces, message_bytes)
    if not msgs:
        return ""
    cap = max(message_size(m) for m in msgs)
    if not buffers or buffers["wire"][0].numel() < cap:
        buffers["wire"] = [torch.empty(cap, dtype=torch.uint8, device=device) for _ in range(2)]
        buffers["host"] = (
            buffers["wire"]
            if device.type == "cpu"
            else [torch.empty(cap, dtype=torch.uint8) for _ in range(2)]
        )
    bufs, host = buffers["wire"], buffers["host"]

    def post(i: int):  # type: ignore[no-untyped-def]
        return dist.irecv(bufs[i % 2][: message_size(msgs[i])], src=sender, tag=i)

    works = {0: post(0)}
    error = ""
    for i, parts in enumerate(msgs):
        wait_or_raise(works.pop(i), timeout, f"receiving message {i} from rank {sender}")
        STATS["received"] += message_size(parts)
        buf = bufs[i % 2]
        if device.type == "cuda":
            host[i % 2][: message_size(parts)].copy_(buf[: message_size(parts)])
            buf = host[i % 2]
        if i + 1 < len(msgs):
            works[i + 1] = post(i + 1)  # the other buffer: free once message i-1 was written
        if error:
            continue
        try:
            for p in parts:
                e = p.piece.entry
                dst = offset_of(e) + (p.piece.dst_elem + p.start) * e.target_dtype.itemsize
                pwrite_from(fd_of(e), buf[p.offset : p.offset + p.nbytes], dst)
        except Exception as exc:
            error = f"writing rank {sender}'s pieces: {type(exc).__name__}: {exc}"
    return error
