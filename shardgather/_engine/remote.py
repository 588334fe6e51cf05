"""Pieces held by ranks on other hosts than rank 0's travel to rank 0 point to point.

With the node-local transport every rank on rank 0's host writes its own pieces to
their final place; a rank elsewhere cannot reach that shared region or that file. It
packs its pieces (already cast to the output dtype, so a bf16 export moves half the
bytes) into messages of at most ``message_bytes`` and sends them to rank 0, which hands
each message to the sink exactly like a gathered bucket (one row). Both sides derive
the same messages from the plan, so only payload crosses the wire; two buffers per
side keep packing, sending and writing overlapped. Messages travel on shardgather's
data group: a rank that fails closes it and every peer raises at once.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _dist
from .._dist import Call
from .buckets import Part
from .pieces import Piece, Rows, message_size, messages, pack_into

# Bytes this process sent to / received from other hosts (cumulative; tests and
# benchmarks read the difference around a call).
STATS = {"sent": 0, "received": 0}


def pack_message(parts: list[Part], buf: torch.Tensor, rows: Rows) -> torch.Tensor:
    """The message for ``parts``: the local row itself when it is one contiguous
    same-dtype part (nothing to copy), else packed (and cast) into ``buf``."""
    if len(parts) == 1:
        p = parts[0]
        assert p.held is not None
        chunk = rows.held(p.entry, p.held)
        if (
            p.held.contiguous
            and p.entry.target_dtype == chunk.dtype
            and chunk.device == buf.device
            and chunk.is_contiguous()
        ):
            return chunk.view(torch.uint8)
    for p in parts:
        assert p.held is not None
        off = p.segment.col_byte
        out = buf[off : off + p.nbytes]
        row = rows.of(p.entry)
        if row.device.type == "cpu":
            pack_into(row, p.held, p.entry.target_dtype, out)
        else:
            out.view(p.entry.target_dtype).copy_(rows.held(p.entry, p.held).reshape(-1))
    return buf[: message_size(parts)]


def send_pieces(call: Call, pieces: list[Piece], message_bytes: int, group: Any) -> None:
    """Send this rank's pieces to rank 0, two messages in flight."""
    msgs = messages(pieces, message_bytes)
    bufs = [torch.empty(0, dtype=torch.uint8) for _ in range(2)]
    pending: list[Any] = [None, None]
    rows = Rows()
    for i, parts in enumerate(msgs):
        slot = i % 2
        if pending[slot] is not None:
            call.wait(pending[slot], f"sending message {i - 2} to rank 0", 0)
        size = message_size(parts)
        if bufs[slot].numel() < size:
            bufs[slot] = torch.empty(size, dtype=torch.uint8)
        payload = pack_message(parts, bufs[slot], rows)
        if payload.is_cuda:
            payload = payload.cpu()
        pending[slot] = _dist.send(group, payload, 0, i)
        STATS["sent"] += size
    for work in pending:
        if work is not None:
            call.wait(work, "sending the last messages to rank 0", 0)


def receive_pieces(
    call: Call, sender: int, pieces: list[Piece], message_bytes: int, group: Any, sink: Any
) -> None:
    """Rank 0: receive ``sender``'s pieces and hand each message to ``sink.write_rows``."""
    msgs = messages(pieces, message_bytes)
    if not msgs:
        return
    cap = max(message_size(m) for m in msgs)
    bufs = [torch.empty(cap, dtype=torch.uint8) for _ in range(2)]

    def post(i: int) -> Any:
        return _dist.recv(group, bufs[i % 2][: message_size(msgs[i])], sender, i)

    works = {0: post(0)}
    for i, parts in enumerate(msgs):
        call.wait(works.pop(i), f"receiving message {i} from rank {sender}", sender)
        n = message_size(parts)
        STATS["received"] += n
        if i + 1 < len(msgs):
            works[i + 1] = post(i + 1)  # the other buffer: message i - 1 is written
        sink.write_rows(bufs[i % 2][:n].view(1, n), parts)
