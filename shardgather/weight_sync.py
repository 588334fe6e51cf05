"""Weight sync for RL: the trainer's full weights into inference processes after every
step, over a process group the two sides share — packed buckets, and then only what
changed.

On the trainer, every rank (FSDP1, FSDP2 or a plain model) holds a
:class:`WeightSender`; global rank 0 is rank 0 of the *sync group*, whose other ranks
are the inference workers, each holding a :class:`WeightReceiver`::

    # trainer, every rank                          # each inference worker i
    group = sg.connect_sync_group(                 group = sg.connect_sync_group(
        host, port, rank=0, world_size=1 + n,          host, port, rank=1 + i,
    ) if dist.get_rank() == 0 else None               world_size=1 + n)
    sender = sg.WeightSender(model, group,         receiver = sg.WeightReceiver(
                             dtype=torch.bfloat16)     group, target=engine_weights)
    for step in ...:                               while True:
        train_step()                                   receiver.receive()
        sender.sync()

**Full sync** (the first, after any layout change, or ``delta=False``): the gatherer's
packed buckets (:meth:`shardgather.Gatherer.iter_packed`: each bucket's full tensors back
to back in one reused buffer, filled by the copy-out op from the gathered rows) are
broadcast from trainer rank 0, one message per bucket, while the next bucket's gather
is in flight. The receiver unpacks each into views and copies them into ``target``
and/or hands ``(name, tensor)`` batches to ``on_weights`` (e.g. vLLM's
``model.load_weights``).

**Delta sync**: every trainer rank keeps what it last sent of its own shard (in the
sent dtype), compares after the step, and encodes the changed elements of its own
pieces — positions + values, or, where that would be larger, its pieces whole as runs —
which rank 0 forwards; the receiver, holding the previous version in ``target``, writes
them in place. Nothing is all-gathered: each element crosses the wire at most once,
only when it changed. Tensors every rank holds whole (buffers) and shardings a delta
cannot address (N-D, replicated) go as packed buckets every time.

Both sides agree on a layout (names, shapes, dtypes) before any data moves: a mismatch
with the receiver's ``target`` is a clear error on both sides. A receiver whose
``on_weights`` raises drains the sync and reports it; the sender then raises on every
trainer rank. A receiver that dies breaks the group: the sender's next message fails,
and every trainer rank raises (the engine's latch), within the timeout.
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import _dist, _ops
from ._dist import Call
from ._options import DEFAULT_TIMEOUT, check_model
from ._plan import GatherPlan, build_plan, own_blocks
from ._plan.subset import KeySelection
from .errors import CollectiveError, ShardGatherError, StateDictMismatchError
from .stream import Gatherer, PackedBucket

MAGIC, VERSION = 0x53475359, 1  # "SGSY"
BEGIN, BUCKET, DELTA, END = 1, 2, 3, 4
FULL, DELTA_MODE = 0, 1
_HEADER = 8
_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_DELTA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # diff_update's
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ConsumerError(CollectiveError):
    """An inference-side receiver refused the layout or failed while applying weights."""


def connect_sync_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    *,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> Any:
    """A gloo process group of the trainer's rank 0 (``rank=0``, which hosts the store
    at ``host:port``) and the inference workers (``1 .. world_size - 1``), independent of
    either side's default group. Call it on each member; it returns when all joined.
    (On GPUs, any process group with ``broadcast``/``allreduce`` works, e.g. NCCL.)"""
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    group = dist.ProcessGroupGloo(
        dist.PrefixStore("shardgather-sync/", store), rank, world_size, opts
    )
    _STORES[id(group)] = store  # the store must outlive the group
    return group


_STORES: dict[int, Any] = {}


# ------------------------------------------------------------------------ the wire


class _Wire:
    """Broadcasts from rank 0 of the sync group, each bounded by the timeout."""

    def __init__(self, group: Any, timeout: datetime.timedelta) -> None:
        self.group, self.timeout = group, timeout
        self.sent = 0

    def _wait(self, work: Any, what: str) -> None:
        try:
            ok = work.wait(self.timeout)
        except Exception as exc:
            raise ConsumerError(f"weight sync: {what} failed ({exc}); a peer died?") from exc
        if ok is False:
            raise ConsumerError(f"weight sync: {what} timed out after {self.timeout}")

    def bcast(self, t: torch.Tensor, what: str) -> None:
        self._wait(self.post(t), what)

    def post(self, t: torch.Tensor) -> Any:
        """A broadcast in flight (wait for it with :meth:`settle`); ``t`` must stay
        alive and unchanged until then."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.sent += t.numel() * t.element_size()
        return self.group.broadcast([t], opts)

    def settle(self, works: list[tuple[Any, str]]) -> None:
        for work, what in works:
            self._wait(work, what)

    def _header(self, kind: int, values: tuple[int, ...]) -> torch.Tensor:
        h = torch.zeros(_HEADER, dtype=torch.int64)
        h[:3] = torch.tensor([MAGIC, VERSION, kind])
        h[3 : 3 + len(values)] = torch.tensor(values, dtype=torch.int64)
        return h

    def header(self, kind: int, *values: int) -> None:
        self.bcast(self._header(kind, values), "a header")

    def post_header(self, kind: int, *values: int) -> tuple[Any, torch.Tensor]:
        h = self._header(kind, values)
        return self.post(h), h

    def read_header(self) -> list[int]:
        h = torch.zeros(_HEADER, dtype=torch.int64)
        self.bcast(h, "a header")
        got = h.tolist()
        if got[0] != MAGIC or got[1] != VERSION:
            raise ConsumerError(
                f"weight sync: a message that is not shardgather's (magic {got[0]:#x}, version "
                f"{got[1]}): both sides must run the same shardgather version"
            )
        return got[2:]

    def blob(self, data: bytes | None, n: int | None = None) -> bytes:
        t = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(n or 0, dtype=torch.uint8)
        )
        if t.numel():
            self.bcast(t, "metadata")
        return bytes(t.numpy())

    def verdict(self, code: int, flag: int = 0) -> tuple[int, int]:
        """Every member's worst (code, flag): the one message a receiver sends back."""
        t = torch.tensor([code, flag], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self._wait(self.group.allreduce([t], opts), "the verdict")
        return int(t[0]), int(t[1])


def _layout_doc(plan: GatherPlan) -> dict[str, Any]:
    tensors = [
        [k, list(plan.entries[k].shape), str(plan.entries[k].target_dtype).replace("torch.", "")]
        for k in plan.keys
        if k in plan.entries
    ]
    return {"fingerprint": plan.fingerprint, "tensors": tensors}


# ------------------------------------------------------------------------ the sender


@dataclass
class _Piece:
    key: str
    position: int  # of its first element in the layout's concatenation
    source: Any
    row_offset: int  # of its first element in this rank's row
    numel: int


@dataclass
class _Delta:
    """This rank's own pieces of the delta-able tensors, per sent dtype, and what it
    last sent of them."""

    pieces: dict[torch.dtype, list[_Piece]] = field(default_factory=dict)
    reference: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)


class WeightSender:
    """Sends a (sharded) model's full weights to the inference side of a sync group.

    Create it on every trainer rank (``group``: the sync group on global rank 0, from
    :func:`connect_sync_group`; ``None`` elsewhere); call :meth:`sync` on every rank
    after each step, in the same order as the receivers call ``receive``.

    Args:
        model: as for :func:`shardgather.full_state_dict` (FSDP1, FSDP2, plain).
        dtype: the dtype sent (cast on the way; e.g. ``torch.bfloat16``).
        keys: only these keys (e.g. ``"trainable"``).
        delta: after the first full sync, send only what changed (see the module doc).
        bucket_mb: bytes per packed bucket (one message).
        timeout: the longest any wait may last, on the trainer and on the wire.
    """

    def __init__(
        self,
        model: nn.Module,
        group: Any,
        *,
        dtype: torch.dtype | None = None,
        keys: KeySelection | None = None,
        delta: bool = True,
        bucket_mb: float | None = None,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        self.model = check_model(model)
        self.dtype, self.keys, self.delta, self.timeout = dtype, keys, delta, timeout
        self.wire = _Wire(group, timeout) if group is not None else None
        self.gatherer = Gatherer(
            model, dtype=dtype, keys=keys, bucket_mb=bucket_mb, timeout=timeout
        )
        self._delta: _Delta | None = None  # set by a full sync the receivers can extend
        self._fingerprint = ""  # of the layout the receivers hold
        self._metas: dict[int, bytes] = {}  # each bucket's contents, as the receivers have them

    def sync(self, *, full: bool = False) -> dict[str, Any]:
        """Send the weights now (every trainer rank). ``full``: send everything even if
        a delta could. Returns what was sent: ``mode``, ``bytes`` (on the wire, from
        rank 0), ``changed`` (delta: elements changed, all ranks)."""
        with Call("WeightSender.sync", self.timeout) as call:
            if call.rank == 0 and self.wire is None:
                raise ShardGatherError("WeightSender: global rank 0 needs the sync group")
            try:
                return self._sync(call, full)
            except BaseException:
                # The receivers' state is unknown: the next sync starts over.
                self._delta, self._fingerprint, self._metas = None, "", {}
                raise

    def _sync(self, call: Call, full: bool) -> dict[str, Any]:
        plan = build_plan(self.model, dtype=self.dtype, keys=self.keys)
        doc = _layout_doc(plan)
        changed_layout = plan.fingerprint != self._fingerprint
        delta = self.delta and not full and not changed_layout and self._delta is not None
        before = self.wire.sent if self.wire else 0
        verdict = (0, 0)
        if self.wire is not None:
            layout = json.dumps(doc).encode() if changed_layout else b""
            self.wire.header(BEGIN, DELTA_MODE if delta else FULL, len(layout))
            self.wire.blob(layout)
            verdict = self.wire.verdict(0, 0)
        no_delta = _agree(
            call,
            "receivers",
            verdict,
            "a receiver refused the layout (its target lacks or shapes differently some "
            "tensors; see its error): nothing was sent",
        )
        self._fingerprint = plan.fingerprint
        changed = None
        if delta:
            changed = self._send_delta(call, plan)
        else:
            self._send_full(call, plan)
            self._delta = None if no_delta else self._remember(plan, call)
        if self.wire is not None:
            self.wire.header(END)
            verdict = self.wire.verdict(0, 0)
        _agree(
            call,
            "applied",
            verdict,
            "a receiver failed while applying the weights (see its error); the next sync "
            "sends everything",
        )
        sent = (self.wire.sent - before) if self.wire else 0
        return {"mode": "delta" if delta else "full", "bytes": sent, "changed": changed}

    # -------------------------------------------------------------- full

    def _send_full(self, call: Call, plan: GatherPlan, keys: set[str] | None = None) -> None:
        sub = plan if keys is None else _subset(plan, keys)
        for i, pb in enumerate(self.gatherer.packed(call, sub)):
            if self.wire is not None:
                self._send_bucket(pb, i + (0 if keys is None else 1 << 20))

    def _send_bucket(self, pb: PackedBucket, i: int) -> None:
        """Bucket ``i`` of this sync: its contents (names, offsets, sizes) only where they
        differ from bucket ``i`` of the last sync (receivers keep them), then its bytes."""
        assert self.wire is not None
        meta = json.dumps([[n, o, z] for n, o, z in zip(pb.names, pb.offsets, pb.sizes)]).encode()
        same = self._metas.get(i) == meta
        self.wire.header(BUCKET, 0 if same else len(meta), pb.nbytes, i)
        if not same:
            self.wire.blob(meta)
            self._metas[i] = meta
        self.wire.bcast(pb.buffer, "a bucket")

    # -------------------------------------------------------------- delta

    def _remember(self, plan: GatherPlan, call: Call) -> _Delta | None:
        """After a full sync: this rank's own pieces of the delta-able tensors, as sent."""
        d = _Delta()
        positions, pos = {}, 0
        for k in plan.keys:
            if k in plan.entries:
                positions[k] = pos
                pos += plan.entries[k].numel
        for k, e in plan.entries.items():
            if not _deltable(e, call):
                continue
            for b in own_blocks(e):
                src = e.source
                d.pieces.setdefault(e.target_dtype, []).append(
                    _Piece(
                        k, positions[k] + b.full, src, b.shard - src.rank * src.row_numel, b.numel
                    )
                )
        old = self._delta.reference if self._delta is not None else {}
        for dt, pieces in d.pieces.items():
            n = sum(p.numel for p in pieces)
            ref = old.get(dt)
            if ref is None or ref.numel() != n:  # else reused: its pages are already there
                ref = torch.empty(n, dtype=dt)
            d.reference[dt] = _current(pieces, dt, ref)
        return d

    def _send_delta(self, call: Call, plan: GatherPlan) -> int:
        """Every rank's changed elements, chunk by chunk, two chunks in flight: a rank
        compares chunk c + 1 (into the other of its two scratch buffers) while chunk c
        is on its way — from rank r to rank 0, and from rank 0 to the receivers — so
        the compare, the relay and the wire overlap instead of taking turns. A rank
        holds at most two chunks of delta at a time (a chunk: at most a bucket's bytes,
        sparse or dense; the two scratch buffers together: one bucket)."""
        assert self._delta is not None
        full_keys = {k for k, e in plan.entries.items() if not _deltable(e, call)}
        if full_keys:
            self._send_full(call, plan, full_keys)
        limit = self.gatherer.options.bucket_bytes(False)
        mine = list(self._chunks(limit))
        counts = call.round("delta chunks", payload=len(mine), gather="all")
        group = _dist.data_group(call) if call.world > 1 else None
        changed = 0
        # Per chunk in flight: (data-group sends or receives to wait for, wire
        # broadcasts to wait for, the tensors they move, kept alive until then).
        flight: list[tuple[list[Any], list[tuple[Any, str]], list[torch.Tensor]]] = []

        def land(sends: list[Any], casts: list[tuple[Any, str]], _: list[torch.Tensor]) -> None:
            for w in sends:
                call.wait(w, "sending a delta to rank 0", 0)
            if casts:
                assert self.wire is not None
                self.wire.settle(casts)

        for c in range(max(counts)):
            while len(flight) >= 2:  # chunk c - 2's scratch is written again now
                land(*flight.pop(0))
            msg = mine[c](c % 2) if c < len(mine) else None
            if msg is not None:
                changed += msg[4]
            sends: list[Any] = []
            casts: list[tuple[Any, str]] = []
            keep: list[torch.Tensor] = []
            flight.append((sends, casts, keep))
            if call.rank != 0:
                if msg is not None:
                    code, dense, _, index, _, values = msg
                    desc = torch.tensor(
                        [code, dense, 0, index.element_size(), index.numel()], dtype=torch.int64
                    )
                    for j, t in enumerate((desc, index, values)):
                        if t.numel():
                            sends.append(_dist.send(group, t, 0, 3 * c + j))
                            keep.append(t)
                continue
            assert self.wire is not None
            for r in range(call.world):
                if c >= counts[r]:
                    continue
                if r == 0:
                    assert msg is not None
                    code, dense, _, index, _, values = msg
                else:
                    desc = torch.empty(5, dtype=torch.int64)
                    call.wait(_dist.recv(group, desc, r, 3 * c), "a delta", r)
                    code, dense, _, size, n_index = desc.tolist()
                    index = torch.empty(n_index, dtype=_BITS[size])
                    if n_index:
                        call.wait(_dist.recv(group, index, r, 3 * c + 1), "a delta", r)
                    n_values = n_index if not dense else int(index.view(-1, 2)[:, 1].sum())
                    values = torch.empty(n_values, dtype=_DTYPES[code])
                    if n_values:
                        call.wait(_dist.recv(group, values, r, 3 * c + 2), "a delta", r)
                work, header = self.wire.post_header(
                    DELTA, code, dense, index.numel(), index.element_size(), values.numel()
                )
                casts.append((work, "a header"))
                keep += [header, index, values]
                if index.numel():
                    casts.append((self.wire.post(index), "a delta's positions"))
                if values.numel():
                    casts.append((self.wire.post(values), "a delta's values"))
        for f in flight:
            land(*f)
        call.round("changed", count=changed)
        return int(call.count)

    def _chunks(self, limit: int):  # type: ignore[no-untyped-def]
        """This rank's delta as chunks of at most ``limit`` bytes (consecutive pieces
        together: small tensors share one message): each a callable of the turn (which
        of two scratch buffers) that compares its elements (updating the reference) and
        returns (dtype code, dense, 0, positions or runs, changed count, values)."""
        assert self._delta is not None
        for dt, pieces in self._delta.pieces.items():
            ref = self._delta.reference[dt]
            last = max((p.position + p.numel for p in pieces), default=0)
            index_dtype = torch.int32 if last < 2**31 else torch.int64
            step = max(1, limit // dt.itemsize)
            # Two chunks in flight, each with half a bucket of (position, value) room.
            cap = (step * dt.itemsize) // (index_dtype.itemsize + dt.itemsize) // 2
            scratch = [
                (torch.empty(cap, dtype=index_dtype), torch.empty(cap, dtype=dt)) for _ in range(2)
            ]
            segs: list[tuple[int, torch.Tensor, int]] = []  # (position, elements, at)
            size = 0
            for p, a, src, at in _rows(pieces, step):
                if size + src.numel() > step and segs:
                    yield lambda turn, segs=segs, ref=ref, scratch=scratch: _chunk_delta(
                        segs, ref, scratch[turn]
                    )
                    segs, size = [], 0
                segs.append((p.position + a, src, at))
                size += src.numel()
            if segs:
                yield lambda turn, segs=segs, ref=ref, scratch=scratch: _chunk_delta(
                    segs, ref, scratch[turn]
                )

    def close(self) -> None:
        self.gatherer.close()
        self._delta = None


def _agree(call: Call, name: str, verdict: tuple[int, int], failure: str) -> int:
    """Every trainer rank learns the receivers' verdict (rank 0 has it from the wire) and
    raises on a failure; returns the verdict's flag."""
    code, flag = call.round(name, payload=verdict, gather="rank0")
    if code:
        raise ConsumerError(f"weight sync: {failure}")
    return int(flag)


def _subset(plan: GatherPlan, keys: set[str]) -> GatherPlan:
    from ._plan.subset import select

    return select(plan, [k for k in plan.keys if plan.aliases.get(k, k) in keys])


def _deltable(e: Any, call: Call) -> bool:
    """Whether every element of ``e`` is held by exactly one trainer rank as contiguous
    pieces a position can address: 1-D sharding over all ranks, a float dtype."""
    src = e.source
    if src.group is None or not e.target_dtype.is_floating_point or not e.is_contiguous:
        return False
    if src.world != call.world or e.target_dtype not in _DELTA_DTYPES:
        return False
    if src.dtype not in _DELTA_DTYPES:
        return False
    return all(b.contiguous for b in own_blocks(e))


def _rows(pieces: list[_Piece], step: int = 1 << 22):  # type: ignore[no-untyped-def]
    """(piece, its elements in this rank's row, where it starts in the concatenation),
    cut in chunks of at most ``step`` elements."""
    rows: dict[int, torch.Tensor] = {}
    at = 0
    for p in pieces:
        row = rows.get(p.source.index)
        if row is None:
            row = rows[p.source.index] = p.source.local().reshape(-1)
        for a in range(0, p.numel, step):
            n = min(step, p.numel - a)
            yield p, a, row[p.row_offset + a : p.row_offset + a + n], at + a
        at += p.numel


def _current(pieces: list[_Piece], dt: torch.dtype, out: torch.Tensor) -> torch.Tensor:
    """This rank's own elements of ``pieces``, concatenated into ``out``, cast to ``dt``."""
    for _, _, src, at in _rows(pieces):
        out[at : at + src.numel()].copy_(src)
    return out


def _chunk_delta(
    segs: list[tuple[int, torch.Tensor, int]],
    ref: torch.Tensor,
    scratch: tuple[torch.Tensor, torch.Tensor],
) -> tuple[int, int, int, torch.Tensor, int, torch.Tensor]:
    """One chunk's delta: the ``diff_update`` op compares each segment (a run of a
    piece, cast to the sent dtype) with ``ref``, updates it, and records (position,
    value) up to the chunk's break-even count; past it the chunk goes dense: a run
    ``(position, count)`` per segment and every value (``ref``, now current)."""
    dt = ref.dtype
    n = sum(src.numel() for _, src, _ in segs)
    cap = (n * dt.itemsize) // (scratch[0].element_size() + dt.itemsize)
    cap = min(cap, scratch[0].numel())  # past the scratch's room, dense is at most 2x larger
    positions, values = scratch[0][:cap], scratch[1][:cap]  # reused chunk to chunk
    k = 0
    for position, src, at in segs:
        room = max(0, cap - k)
        k += _ops.diff_update(
            src, ref[at : at + src.numel()], positions[k : k + room], values[k : k + room], position
        )
    code = _DTYPES.index(dt)
    if k > cap:
        runs = torch.tensor([[pos, src.numel()] for pos, src, _ in segs], dtype=torch.int64)
        first = segs[0][2]
        return code, 1, 0, runs.reshape(-1), k, ref[first : first + n]
    return code, 0, 0, positions[:k], k, values[:k]


# ------------------------------------------------------------------------ the receiver


class WeightReceiver:
    """The inference side of a sync group: receives what a :class:`WeightSender` sends.

    Args:
        group: the sync group (:func:`connect_sync_group`), this worker's rank >= 1.
        target: name -> tensor the weights are written into (e.g.
            ``dict(model.named_parameters())``); it must hold every name sent, in the
            sent shape and dtype, contiguous. Delta syncs need it (they write in place).
        on_weights: called with ``[(name, tensor), ...]`` per bucket of a full sync (views
            into a reused buffer, valid during the call), e.g. vLLM's
            ``model.load_weights``; after ``target`` is written, if both are given.
        timeout: the longest any wait may last.
    """

    def __init__(
        self,
        group: Any,
        *,
        target: Mapping[str, torch.Tensor] | None = None,
        on_weights: Callable[[list[tuple[str, torch.Tensor]]], Any] | None = None,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        self.wire = _Wire(group, timeout)
        self.target = dict(target) if target is not None else None
        self.on_weights = on_weights
        self.layout: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        self._starts = torch.zeros(0, dtype=torch.int64)
        self._buffers = [torch.empty(0, dtype=torch.uint8)] * 2
        self._applier: ThreadPoolExecutor | None = None
        self._metas: dict[int, Any] = {}  # each bucket's contents, as last sent
        self._deltas: dict[tuple[str, int], torch.Tensor] = {}  # delta buffers, two pairs

    def receive(self) -> dict[str, Any]:
        """One sync: returns ``mode`` and ``bytes`` received. Raises
        :class:`StateDictMismatchError` when the layout does not fit ``target``, or what
        ``on_weights`` raised (after the sync was drained and the sender told)."""
        before = self.wire.sent
        kind, mode, layout_len, *_ = self.wire.read_header()
        if kind != BEGIN:
            raise ConsumerError(f"weight sync: expected the start of a sync, got message {kind}")
        problem: BaseException | None = None
        if layout_len:
            doc = json.loads(self.wire.blob(None, layout_len))
            try:
                self._take_layout(doc)
            except StateDictMismatchError as exc:
                problem = exc
        no_delta = 1 if self.target is None else 0
        code, _ = self.wire.verdict(1 if problem else 0, no_delta)
        if problem is not None:
            raise problem
        if code:
            raise ConsumerError("weight sync: another receiver refused the layout")
        failure: BaseException | None = None
        pending: Future | None = None  # the apply of the previous bucket
        turn = 0

        def settle() -> None:
            nonlocal pending, failure
            if pending is not None:
                try:
                    pending.result()
                except Exception as exc:  # the consumer's own failure: drain, then report
                    failure = failure or exc
                pending = None

        while True:
            kind, a, b, c, d, e = self.wire.read_header()
            if kind == END:
                break
            if kind == BUCKET:
                # Two buffers: bucket k is applied (copied into target, handed to
                # on_weights) on a thread while bucket k+1 arrives in the other one.
                meta, buf = self._receive_bucket(a, b, c, turn)
                turn ^= 1
                settle()
                if failure is None:
                    pending = self._pool().submit(self._apply_bucket, meta, buf)
            elif kind == DELTA:
                # As buckets: chunk k is written into target on the thread while chunk
                # k+1 arrives in the other pair of buffers.
                index, values = self._receive_delta(a, c, d, e, turn)
                turn ^= 1
                settle()
                if failure is None:
                    pending = self._pool().submit(self._apply_delta, b, index, values)
            else:
                raise ConsumerError(f"weight sync: unexpected message {kind}")
        settle()
        self.wire.verdict(2 if failure else 0, 0)
        if failure is not None:
            raise failure
        return {"mode": "delta" if mode == DELTA_MODE else "full", "bytes": self.wire.sent - before}

    def _take_layout(self, doc: dict[str, Any]) -> None:
        layout = [(n, tuple(s), getattr(torch, d)) for n, s, d in doc["tensors"]]
        if self.target is not None:
            missing = [n for n, _, _ in layout if n not in self.target]
            wrong = {
                n: f"sent {d} {list(s)}, target {self.target[n].dtype} {list(self.target[n].shape)}"
                for n, s, d in layout
                if n in self.target
                and (tuple(self.target[n].shape) != s or self.target[n].dtype != d)
            }
            if missing or wrong:
                raise StateDictMismatchError(
                    f"weight sync: the trainer sends tensors the target lacks ({missing[:3]}) "
                    f"or holds otherwise ({dict(list(wrong.items())[:3])}); nothing was "
                    "applied. Build the target from the same model, with dtype= as sent.",
                    missing_keys=missing,
                    mismatched=wrong,
                )
        self.layout = layout
        numels = [math.prod(s) for _, s, _ in layout]
        self._starts = torch.tensor([0, *numels], dtype=torch.int64).cumsum(0)
        self._index = {n: i for i, (n, _, _) in enumerate(layout)}

    def _pool(self) -> ThreadPoolExecutor:
        if self._applier is None:
            self._applier = ThreadPoolExecutor(1, thread_name_prefix="sg-weight-apply")
        return self._applier

    def _receive_bucket(
        self, meta_len: int, nbytes: int, index: int, turn: int
    ) -> tuple[Any, torch.Tensor]:
        if meta_len:
            self._metas[index] = json.loads(self.wire.blob(None, meta_len))
        meta = self._metas[index]
        if self._buffers[turn].numel() < nbytes:
            self._buffers[turn] = torch.empty(0, dtype=torch.uint8)
            self._buffers[turn] = torch.empty(nbytes, dtype=torch.uint8)
        buf = self._buffers[turn][:nbytes]
        self.wire.bcast(buf, "a bucket")
        return meta, buf

    def _apply_bucket(self, meta: Any, buf: torch.Tensor) -> None:
        batch = []
        for name, offset, size in meta:
            _, shape, dtype = self.layout[self._index[name]]
            t = buf[offset : offset + size].view(dtype).view(shape)
            if self.target is not None:
                self.target[name].copy_(t)
            batch.append((name, t))
        if self.on_weights is not None:
            self.on_weights(batch)

    def close(self) -> None:
        if self._applier is not None:
            self._applier.shutdown()
            self._applier = None
        self._buffers = [torch.empty(0, dtype=torch.uint8)] * 2

    def _receive_delta(
        self, dt_code: int, n_index: int, index_size: int, n_values: int, turn: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        index = self._scratch(("index", turn), n_index * index_size).view(_BITS[index_size])
        dt = _DTYPES[dt_code]
        values = self._scratch(("values", turn), n_values * dt.itemsize).view(dt)
        if n_index:
            self.wire.bcast(index, "a delta's positions")
        if n_values:
            self.wire.bcast(values, "a delta's values")
        return index, values

    def _scratch(self, key: tuple[str, int], nbytes: int) -> torch.Tensor:
        buf = self._deltas.get(key)
        if buf is None or buf.numel() < nbytes:
            self._deltas[key] = buf = torch.empty(max(nbytes, 64), dtype=torch.uint8)
        return buf[:nbytes]

    def _apply_delta(self, dense: int, index: torch.Tensor, values: torch.Tensor) -> None:
        """Positions (sorted) + values, or runs ``(position, count)`` + values, written
        into ``target`` in place."""
        if self.target is None:
            raise ShardGatherError("weight sync: a delta needs a target (the sender was told)")
        if dense:
            at = 0
            for start, count in index.view(-1, 2).tolist():
                i = int(torch.searchsorted(self._starts, torch.tensor(start), right=True)) - 1
                name = self.layout[i][0]
                off = start - int(self._starts[i])
                self.target[name].view(-1)[off : off + count].copy_(values[at : at + count])
                at += count
            return
        if not index.numel():
            return
        # Where each tensor's positions begin: T binary searches into the sorted
        # positions (not one per position), then one index_copy_ per tensor touched.
        bounds = torch.searchsorted(index, self._starts.to(index.dtype)).tolist()
        for i, (a, b) in enumerate(itertools.pairwise(bounds)):
            if b > a:
                flat = self.target[self.layout[i][0]].view(-1)
                where = (index[a:b] - int(self._starts[i])).to(torch.int64)
                flat.index_copy_(0, where, values[a:b])
