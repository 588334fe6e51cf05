"""Weight sync for RL: the trainer's full weights into inference processes after every
step, over a process group the two sides share — each rank's own pieces, packed buckets,
and then only what changed.

On the trainer, every rank (FSDP1, FSDP2 or a plain model) holds a
:class:`WeightSender`; the inference workers each hold a :class:`WeightReceiver`. The
*sync group* (:func:`connect_sync_group`) has the trainer's ranks first and the workers
after them::

    # trainer, every rank r of T                   # each inference worker i of n
    group = sg.connect_sync_group(                 group = sg.connect_sync_group(
        host, port, rank=r, world_size=T + n)          host, port, rank=T + i,
    sender = sg.WeightSender(model, group,             world_size=T + n)
                             dtype=torch.bfloat16)  receiver = sg.WeightReceiver(
    for step in ...:                                   group, target=engine_weights)
        train_step()                               while True:
        sender.sync()                                  receiver.receive()

**Direct** (the group on every trainer rank, as above): a full sync has every rank cast
its own pieces into what it keeps as sent and send them from there, point to point,
straight into each worker's ``target`` — no rank gathers anything, each element crosses
the wire once, from the rank that holds it, all ranks at once. **Relayed** (only trainer
rank 0 in the group, ``world_size=1 + n``, ``None`` on the other ranks — for engines
that can join one trainer process only): the gatherer's packed buckets
(:meth:`shardgather.Gatherer.iter_packed`: each bucket's full tensors back to back in
one reused buffer, filled by the copy-out op from the gathered rows) are broadcast from
rank 0, one message per bucket, while the next bucket's gather is in flight. In both,
tensors no rank holds alone (buffers, N-D and replicated layouts) go as packed buckets
from rank 0, and so does everything for a receiver without a ``target``: it unpacks
each bucket into views and hands ``(name, tensor)`` batches to ``on_weights`` (e.g.
vLLM's ``model.load_weights``).

**Delta sync**: every trainer rank keeps what it last sent of its own pieces (in the
sent dtype), compares after the step, and encodes the changed elements — positions +
values, or, where that would be larger, its pieces whole as runs — sent straight to the
workers (relayed: forwarded by rank 0); the receiver, holding the previous version in
``target``, writes them in place. Nothing is all-gathered: each element crosses the
wire at most once, only when it changed.

Both sides agree on a layout (names, shapes, dtypes) before any data moves: a mismatch
with the receiver's ``target`` is a clear error on both sides. A receiver whose
``on_weights`` raises drains the sync and reports it; the sender then raises on every
trainer rank. A receiver that dies breaks the group: the sender's next message fails,
and every trainer rank raises (the engine's latch), within the timeout.
"""

from __future__ import annotations

import bisect
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
from .errors import CollectiveError, ConsumerError, ShardGatherError, StateDictMismatchError
from .stream import Gatherer, PackedBucket

MAGIC, VERSION = 0x53475359, 1  # "SGSY"
BEGIN, BUCKET, DELTA, END, PIECES = 1, 2, 3, 4, 5
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


def connect_sync_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    *,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> Any:
    """A gloo process group of the trainer's ranks and the inference workers,
    independent of either side's default group: trainer rank r joins as ``rank=r``
    (rank 0 hosts the store at ``host:port``), the workers after them, up to
    ``world_size - 1`` — or only trainer rank 0 joins (``rank=0``), for a relayed sync.
    Call it on each member; it returns when all joined. (On GPUs, any process group with
    ``send``/``recv``/``broadcast``/``allreduce`` works, e.g. NCCL.)

    Args:
        host: an address of trainer rank 0's machine that every member can reach (e.g.
            its hostname or IP; ``"127.0.0.1"`` when all run on one machine).
        port: a free TCP port there, the same on every member: rank 0 listens on it.
        rank, world_size: this member's rank in the sync group, and its size.
        timeout: the bound of every later wait of the group's messages.

    Raises:
        CollectiveError: a member did not join within the arrival bound
            (:func:`shardgather.set_arrival_timeout`, default 60 s), naming the missing
            ranks and the address they were awaited at; or this member could not reach
            rank 0's store there.
    """
    where = f"{host}:{port}"
    arrival = min(timeout, _dist._ARRIVAL["timeout"])
    try:
        store = dist.TCPStore(
            host, port, world_size, is_master=rank == 0, timeout=arrival, wait_for_workers=False
        )
    except Exception as exc:
        raise CollectiveError(
            f"connect_sync_group: rank {rank} could not reach the sync group's store at "
            f"{where} within {arrival} ({_dist._describe(exc)}): trainer rank 0 listens "
            "there — is it running, and is that the address of its machine (reachable "
            "from here) and a port that is free there?"
        ) from exc
    joined = [f"shardgather-sync-joined/{r}" for r in range(world_size)]
    store.set(joined[rank], "1")
    try:
        store.wait(joined, arrival)
    except Exception:
        missing = [r for r in range(world_size) if not store.check([joined[r]])]
        if missing:
            raise CollectiveError(
                f"connect_sync_group: rank{'s' if len(missing) > 1 else ''} "
                f"{', '.join(map(str, missing))} of the sync group (size {world_size}) did "
                f"not join at {where} within {arrival}: start every member with the same "
                "address, world size and its own rank (trainer rank r as rank r, the "
                "workers after them), or raise the bound with sg.set_arrival_timeout"
            ) from None
    store.set_timeout(timeout)
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
    """The sync group's messages, each wait bounded by the timeout.

    Two kinds: **control** (a sync's start, its layout, the verdicts) goes to every
    member — broadcasts from rank 0 and all-reduces, which every trainer rank in the
    group takes part in; **streams** carry the data, one per sending trainer rank. With
    only trainer rank 0 in the group (*relayed*), its stream is broadcasts too; with
    every trainer rank in it (*direct*: ranks ``0 .. trainers - 1`` are the trainer's,
    the rest workers), each trainer rank sends its own stream to every worker point to
    point and a worker reads each stream in the order it was sent."""

    def __init__(self, group: Any, timeout: datetime.timedelta, *, receiver: bool = False) -> None:
        self.group, self.timeout = group, timeout
        self.sent = 0  # bytes this member sent (a receiver: received)
        # Control broadcasts count on their root and where they are received by a worker.
        self._counts_control = receiver or group.rank() == 0
        self.direct = False
        self.workers: list[int] = []  # direct: the group ranks a stream goes to

    def _wait(self, work: Any, what: str) -> None:
        try:
            ok = work.wait(self.timeout)
        except Exception as exc:
            raise ConsumerError(f"weight sync: {what} failed ({exc}); a peer died?") from exc
        if ok is False:
            raise ConsumerError(f"weight sync: {what} timed out after {self.timeout}")

    # -------------------------------------------------------------- control

    def bcast(self, t: torch.Tensor, what: str) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if self._counts_control:
            self.sent += t.numel() * t.element_size()
        self._wait(self.group.broadcast([t], opts), what)

    def _header(self, kind: int, values: tuple[int, ...]) -> torch.Tensor:
        h = torch.zeros(_HEADER, dtype=torch.int64)
        h[:3] = torch.tensor([MAGIC, VERSION, kind])
        h[3 : 3 + len(values)] = torch.tensor(values, dtype=torch.int64)
        return h

    def header(self, kind: int, *values: int) -> None:
        self.bcast(self._header(kind, values), "a header")

    def read_header(self) -> list[int]:
        h = torch.zeros(_HEADER, dtype=torch.int64)
        self.bcast(h, "a header")
        return self._check(h)

    def _check(self, h: torch.Tensor) -> list[int]:
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

    def verdict(self, code: int, flag: int = 0, count: int = 0) -> tuple[int, int, int]:
        """Summed over every member: (code, flag, count) — a code or flag is set when any
        member set it; ``count``, e.g. the elements each trainer rank found changed."""
        t = torch.tensor([code, flag, count], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self._wait(self.group.allreduce([t], opts), "the verdict")
        return int(t[0]), int(t[1]), int(t[2])

    # -------------------------------------------------------------- streams

    def post(self, t: torch.Tensor) -> list[Any]:
        """This rank's stream: ``t`` on its way to every worker (wait for the returned
        works with :meth:`settle`); ``t`` must stay alive and unchanged until then."""
        if not self.direct:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            self.sent += t.numel() * t.element_size()
            return [self.group.broadcast([t], opts)]
        self.sent += t.numel() * t.element_size() * len(self.workers)
        return [self.group.send([t], w, 0) for w in self.workers]

    def post_header(self, kind: int, *values: int) -> tuple[list[Any], torch.Tensor]:
        h = self._header(kind, values)
        return self.post(h), h

    def put(self, t: torch.Tensor, what: str) -> None:
        self.settle([(w, what) for w in self.post(t)])

    def put_header(self, kind: int, *values: int) -> None:
        works, _ = self.post_header(kind, *values)
        self.settle([(w, "a header") for w in works])

    def settle(self, works: list[tuple[Any, str]]) -> None:
        for work, what in works:
            self._wait(work, what)

    def take(self, t: torch.Tensor, src: int) -> Any:
        """A worker: the next message of trainer rank ``src``'s stream into ``t``, in
        flight (relayed: rank 0's broadcast)."""
        self.sent += t.numel() * t.element_size()
        if not self.direct:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            return self.group.broadcast([t], opts)
        return self.group.recv([t], src, 0)

    def get(self, t: torch.Tensor, src: int, what: str) -> torch.Tensor:
        if t.numel():
            self._wait(self.take(t, src), what)
        return t

    def get_header(self, src: int) -> list[int]:
        return self._check(self.get(torch.zeros(_HEADER, dtype=torch.int64), src, "a header"))


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

    Create it on every trainer rank and call :meth:`sync` on every rank after each
    step, in the same order as the receivers call ``receive``. ``group``: the sync
    group (:func:`connect_sync_group`) — either on every trainer rank (*direct*: each
    rank sends its own pieces to the workers; the fast way) or on global rank 0 only,
    ``None`` elsewhere (*relayed*: rank 0 gathers and sends everything, for engines
    that can only join one trainer process).

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
        self._direct: bool | None = None  # learnt by the first sync
        self._delta: _Delta | None = None  # set by a full sync the receivers can extend
        self._fingerprint = ""  # of the layout the receivers hold
        self._metas: dict[int, bytes] = {}  # each bucket's contents, as the receivers have them
        self._rows: torch.Tensor | None = None  # direct: this rank's pieces, as they have them

    def sync(self, *, full: bool = False) -> dict[str, Any]:
        """Send the weights now (every trainer rank). ``full``: send everything even if
        a delta could. Returns what was sent: ``mode``, ``bytes`` (on the wire, from
        this rank; relayed: all from rank 0), ``changed`` (delta: elements changed, all
        ranks)."""
        with Call("WeightSender.sync", self.timeout) as call:
            try:
                if self._direct is None:
                    self._direct = self._learn_mode(call)
                return self._sync(call, full)
            except BaseException:
                # The receivers' state is unknown: the next sync starts over — the mode
                # too (a rank that learnt it before the failure must not skip the round
                # the others run again).
                self._delta, self._fingerprint, self._metas, self._rows = None, "", {}, None
                self._direct = None
                raise

    def _learn_mode(self, call: Call) -> bool:
        """Direct when every trainer rank holds the sync group (as its ranks 0 .. world
        - 1), relayed when global rank 0 alone does."""
        held = call.round("sync group", payload=self.wire is not None, gather="all")
        if all(held) and call.world > 1:
            assert self.wire is not None
            size, mine = self.wire.group.size(), self.wire.group.rank()
            if mine != call.rank or size <= call.world:
                raise ShardGatherError(
                    f"WeightSender: trainer rank {call.rank} is rank {mine} of a sync group "
                    f"of {size}: with the group on every trainer rank, trainer rank r must "
                    f"join it as rank r and the workers as ranks {call.world} and up"
                )
            self.wire.direct = True
            self.wire.workers = list(range(call.world, size))
            return True
        if not held[0] or any(held[1:]):
            raise ShardGatherError(
                "WeightSender needs the sync group on every trainer rank (direct) or on "
                f"global rank 0 alone (relayed); ranks {[r for r, h in enumerate(held) if h]} "
                "of the trainer hold one"
            )
        if self.wire is not None:
            self.wire.workers = list(range(1, self.wire.group.size()))
        return False

    def _sync(self, call: Call, full: bool) -> dict[str, Any]:
        plan = build_plan(self.model, dtype=self.dtype, keys=self.keys)
        doc = _layout_doc(plan)
        changed_layout = plan.fingerprint != self._fingerprint
        delta = self.delta and not full and not changed_layout and self._delta is not None
        before = self.wire.sent if self.wire else 0
        verdict = (0, 0, 0)
        if changed_layout:  # receivers forget every rank's pieces with a new layout
            self._rows = None
        if self.wire is not None:
            layout = json.dumps(doc).encode() if changed_layout else b""
            trainers = call.world if self._direct else 1
            self.wire.header(BEGIN, DELTA_MODE if delta else FULL, len(layout), trainers)
            self.wire.blob(layout)
            verdict = self.wire.verdict(0, 0)
        no_delta = self._agree(
            call,
            "receivers",
            verdict,
            "a receiver refused the layout (its target lacks or shapes differently some "
            "tensors; see its error): nothing was sent",
        )
        self._fingerprint = plan.fingerprint
        changed = 0
        if delta:
            changed = self._send_delta(call, plan)
        elif self._direct and not no_delta:  # every receiver has a target to write into
            self._send_full_direct(call, plan)
        else:
            self._send_full(call, plan)
            self._delta = None if no_delta else self._remember(plan, call)
        if self.wire is not None:
            self.wire.put_header(END)
            verdict = self.wire.verdict(0, 0, changed)
        self._agree(
            call,
            "applied",
            verdict,
            "a receiver failed while applying the weights (see its error); the next sync "
            "sends everything",
        )
        total = None  # elements changed, all ranks (a delta)
        if delta and not self._direct:
            call.round("changed", count=changed)
            total = int(call.count)
        elif delta:
            total = verdict[2]
        sent = (self.wire.sent - before) if self.wire else 0
        return {"mode": "delta" if delta else "full", "bytes": sent, "changed": total}

    def _agree(self, call: Call, name: str, verdict: tuple[int, int, int], failure: str) -> int:
        """Every trainer rank learns the receivers' verdict (direct: from the wire; relayed:
        rank 0 has it and tells the others) and raises on a failure; returns its flag."""
        if not self._direct:
            verdict = call.round(name, payload=verdict, gather="rank0")
        if verdict[0]:
            raise ConsumerError(f"weight sync: {failure}")
        return int(verdict[1])

    # -------------------------------------------------------------- full

    def _send_full(self, call: Call, plan: GatherPlan, keys: set[str] | None = None) -> None:
        """Packed buckets, gathered to and sent from rank 0."""
        sub = plan if keys is None else _subset(plan, keys)
        for i, pb in enumerate(self.gatherer.packed(call, sub)):
            if self.wire is not None and call.rank == 0:
                self._send_bucket(pb, i + (0 if keys is None else 1 << 20))

    def _send_bucket(self, pb: PackedBucket, i: int) -> None:
        """Bucket ``i`` of this sync: its contents (names, offsets, sizes) only where they
        differ from bucket ``i`` of the last sync (receivers keep them), then its bytes."""
        assert self.wire is not None
        meta = json.dumps([[n, o, z] for n, o, z in zip(pb.names, pb.offsets, pb.sizes)]).encode()
        same = self._metas.get(i) == meta
        self.wire.put_header(BUCKET, 0 if same else len(meta), pb.nbytes, i)
        if not same:
            self.wire.put(torch.frombuffer(bytearray(meta), dtype=torch.uint8), "metadata")
            self._metas[i] = meta
        self.wire.put(pb.buffer, "a bucket")

    def _send_full_direct(self, call: Call, plan: GatherPlan) -> None:
        """Direct: the tensors no rank holds alone go as packed buckets from rank 0; then
        every rank casts its own pieces into what it keeps as sent (the delta's
        reference) and sends them from there, each straight into the workers' targets —
        nothing is gathered, each element crosses the wire once, from its owner."""
        assert self.wire is not None
        full_keys = {k for k, e in plan.entries.items() if not _deltable(e, call)}
        if full_keys:
            self._send_full(call, plan, full_keys)
        d = self._own(plan, call)
        rows = torch.tensor(
            [
                [p.position + a, src.numel()]
                for dt in d.pieces
                for p, a, src, _ in _rows(d.pieces[dt])
            ],
            dtype=torch.int64,
        ).reshape(-1, 2)
        same = self._rows is not None and torch.equal(self._rows, rows)
        self.wire.put_header(PIECES, 0 if same else rows.shape[0])
        if not same:
            self.wire.put(rows, "the pieces' places")
            self._rows = rows
        works: list[tuple[Any, str]] = []
        for dt, pieces in d.pieces.items():
            ref = d.reference[dt]
            for _, _, src, at in _rows(pieces):
                view = ref[at : at + src.numel()]
                view.copy_(src)  # cast while the last piece is on the wire
                works += [(w, "a piece") for w in self.wire.post(view)]
        self.wire.settle(works)
        self._delta = d if self.delta else None

    # -------------------------------------------------------------- delta

    def _own(self, plan: GatherPlan, call: Call) -> _Delta:
        """This rank's own pieces of the delta-able tensors, per sent dtype, and room for
        them as sent (the last reference's buffers where they fit: their pages are
        already there)."""
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
            d.reference[dt] = (
                ref if ref is not None and ref.numel() == n else torch.empty(n, dtype=dt)
            )
        return d

    def _remember(self, plan: GatherPlan, call: Call) -> _Delta:
        """After a relayed full sync: this rank's own pieces, as sent."""
        d = self._own(plan, call)
        for dt, pieces in d.pieces.items():
            _current(pieces, dt, d.reference[dt])
        return d

    def _send_delta(self, call: Call, plan: GatherPlan) -> int:
        assert self._delta is not None
        full_keys = {k for k, e in plan.entries.items() if not _deltable(e, call)}
        if full_keys:
            self._send_full(call, plan, full_keys)
        limit = self.gatherer.options.bucket_bytes(False)
        if self._direct:
            return self._send_delta_direct(limit)
        return self._send_delta_relayed(call, limit)

    def _send_delta_direct(self, limit: int) -> int:
        """Direct: this rank's changed elements, chunk by chunk, straight to the workers,
        two chunks in flight (it compares chunk c + 1 into its other scratch buffer while
        chunk c is on the wire). A chunk where nothing changed sends nothing."""
        assert self.wire is not None
        changed = 0
        flight: list[tuple[list[tuple[Any, str]], list[torch.Tensor]]] = []
        for c, compare in enumerate(self._chunks(limit)):
            while len(flight) >= 2:  # chunk c - 2's scratch is written again now
                self.wire.settle(flight.pop(0)[0])
            code, dense, _, index, k, values = compare(c % 2)
            changed += k
            if not index.numel():
                continue
            works, header = self.wire.post_header(
                DELTA, code, dense, index.numel(), index.element_size(), values.numel()
            )
            works += self.wire.post(index) + self.wire.post(values)
            flight.append(([(w, "a delta") for w in works], [header, index, values]))
        for works, _ in flight:
            self.wire.settle(works)
        return changed

    def _send_delta_relayed(self, call: Call, limit: int) -> int:
        """Relayed: every rank's changed elements, chunk by chunk, two chunks in flight:
        a rank compares chunk c + 1 (into the other of its two scratch buffers) while
        chunk c is on its way — from rank r to rank 0, and from rank 0 to the receivers —
        so the compare, the relay and the wire overlap instead of taking turns. A rank
        holds at most two chunks of delta at a time (a chunk: at most a bucket's bytes,
        sparse or dense; the two scratch buffers together: one bucket)."""
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
                works, header = self.wire.post_header(
                    DELTA, code, dense, index.numel(), index.element_size(), values.numel()
                )
                casts += [(w, "a header") for w in works]
                keep += [header, index, values]
                if index.numel():
                    casts += [(w, "a delta's positions") for w in self.wire.post(index)]
                if values.numel():
                    casts += [(w, "a delta's values") for w in self.wire.post(values)]
        for f in flight:
            land(*f)
        return changed

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
    hit = []  # the segments where anything changed
    for seg in segs:
        position, src, at = seg
        room = max(0, cap - k)
        got = _ops.diff_update(
            src, ref[at : at + src.numel()], positions[k : k + room], values[k : k + room], position
        )
        k += got
        if got:
            hit.append(seg)
    code = _DTYPES.index(dt)
    if k > cap:
        # Dense: only the segments that changed (a frozen layer beside a trained one
        # sends nothing, and the receiver reloads nothing of it).
        runs = torch.tensor([[pos, src.numel()] for pos, src, _ in hit], dtype=torch.int64)
        if len(hit) == len(segs):
            first = segs[0][2]
            dense = ref[first : first + n]
        else:
            dense = torch.cat([ref[at : at + src.numel()] for _, src, at in hit])
        return code, 1, 0, runs.reshape(-1), k, dense
    return code, 0, 0, positions[:k], k, values[:k]


# ------------------------------------------------------------------------ the receiver


class WeightReceiver:
    """The inference side of a sync group: receives what a :class:`WeightSender` sends.

    Args:
        group: the sync group (:func:`connect_sync_group`), this worker's rank >= 1.
        target: name -> tensor the weights are written into (e.g.
            ``dict(model.named_parameters())``); it must hold every name sent, in the
            sent shape and dtype, contiguous. Delta syncs need it (they write in place).
            Or a function of the layout (``[(name, shape, dtype), ...]``, as sent) that
            returns one: called when a layout first arrives, before any data moves; it
            may raise :class:`StateDictMismatchError` to refuse the layout (both sides
            then fail and nothing is written).
        on_weights: called with ``[(name, tensor), ...]`` per bucket of a full sync (views
            into a reused buffer, valid during the call), e.g. vLLM's
            ``model.load_weights``; after ``target`` is written, if both are given.
        on_synced: called with the names written, once a sync's data is all in
            ``target`` (full or delta) and before the trainers are told it was applied:
            an engine's reload from ``target`` (what it raises, the trainers raise too).
        timeout: the longest any wait may last.
    """

    def __init__(
        self,
        group: Any,
        *,
        target: Mapping[str, torch.Tensor]
        | Callable[[list[tuple[str, tuple[int, ...], torch.dtype]]], Mapping[str, torch.Tensor]]
        | None = None,
        on_weights: Callable[[list[tuple[str, torch.Tensor]]], Any] | None = None,
        on_synced: Callable[[list[str]], Any] | None = None,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        self.wire = _Wire(group, timeout, receiver=True)
        self._make_target = target if callable(target) else None
        self.target = dict(target) if target is not None and not callable(target) else None
        self.on_weights = on_weights
        self.on_synced = on_synced
        self._written: set[int] = set()  # layout positions written by this sync
        self.layout: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        self._starts = torch.zeros(0, dtype=torch.int64)
        self._buffers = [torch.empty(0, dtype=torch.uint8)] * 2
        self._applier: ThreadPoolExecutor | None = None
        self._metas: dict[int, Any] = {}  # each bucket's contents, as last sent
        self._deltas: dict[tuple[str, int], torch.Tensor] = {}  # delta buffers, two pairs
        self._pieces: dict[int, torch.Tensor] = {}  # direct: each trainer rank's pieces

    def receive(self) -> dict[str, Any]:
        """One sync: returns ``mode`` and ``bytes`` received. Raises
        :class:`StateDictMismatchError` when the layout does not fit ``target``, or what
        ``on_weights`` raised (after the sync was drained and the sender told)."""
        before = self.wire.sent
        kind, mode, layout_len, trainers, *_ = self.wire.read_header()
        if kind != BEGIN:
            raise ConsumerError(f"weight sync: expected the start of a sync, got message {kind}")
        self.wire.direct = trainers > 1
        problem: BaseException | None = None
        if layout_len:
            self._pieces = {}  # each trainer rank's pieces are sent again with a new layout
            doc = json.loads(self.wire.blob(None, layout_len))
            try:
                self._take_layout(doc)
            except StateDictMismatchError as exc:
                problem = exc
        no_delta = 1 if self.target is None and self._make_target is None else 0
        code, _, _ = self.wire.verdict(1 if problem else 0, no_delta)
        if problem is not None:
            raise problem
        if code:
            raise ConsumerError("weight sync: another receiver refused the layout")
        failure: BaseException | None = None
        pending: Future | None = None  # the apply of the previous message
        landing: list[tuple[Any, str]] = []  # pieces received straight into the target
        turn = 0

        def settle() -> None:
            nonlocal pending, failure
            if pending is not None:
                try:
                    pending.result()
                except Exception as exc:  # the consumer's own failure: drain, then report
                    failure = failure or exc
                pending = None

        # One stream per trainer rank that sends (relayed: rank 0's broadcasts), read a
        # message from each in turn until each has ended — but rank 0's buckets back to
        # back: the other ranks send nothing until the gathers that fill them are done.
        streams = list(range(trainers))
        at = 0  # which of them is read next
        while streams:
            src = streams[at]
            kind, a, b, c, d, e = self.wire.get_header(src)
            if kind == END:
                streams.pop(at)
                at = at % len(streams) if streams else 0
                continue
            if kind == BUCKET:  # the same stream is read next
                # Two buffers: bucket k is applied (copied into target, handed to
                # on_weights) on a thread while bucket k+1 arrives in the other one.
                meta, buf = self._receive_bucket(a, b, c, turn, src)
                turn ^= 1
                settle()
                if failure is None:
                    pending = self._pool().submit(self._apply_bucket, meta, buf)
                continue
            if kind == DELTA:
                # As buckets: chunk k is written into target on the thread while chunk
                # k+1 arrives in the other pair of buffers.
                index, values = self._receive_delta(a, c, d, e, turn, src)
                turn ^= 1
                settle()
                if failure is None:
                    pending = self._pool().submit(self._apply_delta, b, index, values)
            elif kind == PIECES:
                landing += self._receive_pieces(src, a)
            else:
                raise ConsumerError(f"weight sync: unexpected message {kind}")
            at = (at + 1) % len(streams)
        self.wire.settle(landing)
        settle()
        if landing:
            self._written.update(self._landed())
        names = [self.layout[i][0] for i in sorted(self._written)]
        self._written = set()
        if landing and failure is None and self.on_weights is not None:
            try:
                self.on_weights([(n, self.target[n]) for n in names])  # type: ignore[index]
            except Exception as exc:
                failure = exc
        if failure is None and self.on_synced is not None:
            try:
                self.on_synced(names)
            except Exception as exc:
                failure = exc
        self.wire.verdict(2 if failure else 0, 0)
        if failure is not None:
            raise failure
        return {
            "mode": "delta" if mode == DELTA_MODE else "full",
            "bytes": self.wire.sent - before,
            "names": names,
        }

    def _receive_pieces(self, src: int, n_rows: int) -> list[tuple[Any, str]]:
        """Direct: trainer rank ``src``'s own pieces, each received straight into its
        place in ``target``; their places (layout position, elements) come with a new
        layout and are kept."""
        if n_rows:
            self._pieces[src] = self.wire.get(
                torch.empty(n_rows * 2, dtype=torch.int64), src, "the pieces' places"
            ).view(-1, 2)
        if self.target is None:
            raise ConsumerError("weight sync: pieces need a target (the sender was told)")
        rows = self._pieces[src].tolist()
        starts = self._starts.tolist()
        works = []
        for position, count in rows:
            i = bisect.bisect_right(starts, position) - 1
            off = position - starts[i]
            view = self.target[self.layout[i][0]].view(-1)[off : off + count]
            works.append((self.wire.take(view, src), "a piece"))
        return works

    def _landed(self) -> set[int]:
        """The layout positions direct pieces were written to."""
        starts = self._starts.tolist()
        hit = set()
        for rows in self._pieces.values():
            for position, _ in rows.tolist():
                hit.add(bisect.bisect_right(starts, position) - 1)
        return hit

    def _take_layout(self, doc: dict[str, Any]) -> None:
        layout = [(n, tuple(s), getattr(torch, d)) for n, s, d in doc["tensors"]]
        if self._make_target is not None:  # may refuse it (StateDictMismatchError)
            self.target = None
            self.target = dict(self._make_target(layout))
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
        self, meta_len: int, nbytes: int, index: int, turn: int, src: int
    ) -> tuple[Any, torch.Tensor]:
        if meta_len:
            raw = self.wire.get(torch.empty(meta_len, dtype=torch.uint8), src, "metadata")
            self._metas[index] = json.loads(bytes(raw.numpy()))
        meta = self._metas[index]
        if self._buffers[turn].numel() < nbytes:
            self._buffers[turn] = torch.empty(0, dtype=torch.uint8)
            self._buffers[turn] = torch.empty(nbytes, dtype=torch.uint8)
        buf = self.wire.get(self._buffers[turn][:nbytes], src, "a bucket")
        return meta, buf

    def _apply_bucket(self, meta: Any, buf: torch.Tensor) -> None:
        batch = []
        for name, offset, size in meta:
            self._written.add(self._index[name])
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
        self, dt_code: int, n_index: int, index_size: int, n_values: int, turn: int, src: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        index = self._scratch(("index", turn), n_index * index_size).view(_BITS[index_size])
        dt = _DTYPES[dt_code]
        values = self._scratch(("values", turn), n_values * dt.itemsize).view(dt)
        self.wire.get(index, src, "a delta's positions")
        self.wire.get(values, src, "a delta's values")
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
                self._written.add(i)
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
                self._written.add(i)
                flat = self.target[self.layout[i][0]].view(-1)
                where = (index[a:b] - int(self._starts[i])).to(torch.int64)
                flat.index_copy_(0, where, values[a:b])
