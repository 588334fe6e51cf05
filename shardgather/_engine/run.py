"""The engine: plan -> transport -> sink, the one path every verb drives.

``gather`` moves an agreed plan's entries into a sink (a host dict or files):

1. rank 0 chooses the transport (node-local where it can run, else collective; it
   alone knows its free shared memory) and prepares the sink (regions, temporary
   files); the **plan round** agrees on the plan and hands rank 0's choice and
   names to everyone — the only round of a repeated call before data moves;
2. data moves: node-local, each rank on rank 0's host writes its own pieces and ranks
   elsewhere send theirs to rank 0; collective, bucket gathers to the receiving ranks;
3. each rank flushes its own writes; the **done round** agrees that every rank
   succeeded; the sink finishes (rank 0 publishes a file: one more round).

``stream`` is the collective transport as a generator (one bucket at a time) for
``Gatherer.iter_full_tensors``. A failure anywhere is posted to the call's latch and
raised on every rank (``_dist``); the sink's ``abort`` removes what it made.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .. import _dist
from .._dist import Call, data_group
from .._options import Options, Transport
from .._plan import GatherPlan
from .._progress import Progress
from . import node_local
from .buckets import Bucket, bucket_parts, my_buckets
from .collective import BucketGathers, gather_buckets
from .pieces import pieces_of, write_pieces
from .remote import receive_pieces, send_pieces
from .sinks import HostDict, Sink


def on_cuda(plan: GatherPlan) -> bool:
    """Whether any gathered source lives on a GPU (then buckets are 256 MiB, not 16)."""
    return any(s.group is not None and s.device.type == "cuda" for s in plan.sources)


def host_buckets(plan: GatherPlan) -> bool:
    """Whether host rows are gathered: then the data group is needed. From the plan,
    not from this rank's buckets: every rank must answer alike (with rank0_only, the
    other HSDP replicas have no buckets, yet build the group with everyone)."""
    return any(s.group is not None and s.device.type != "cuda" for s in plan.sources)


def gather(
    call: Call, plan: GatherPlan, sink: Sink, opts: Options, bar: Progress | None = None
) -> Any:
    """Every primary entry of ``plan`` into ``sink``; returns ``sink.finish``'s result.
    Collective: every rank, same plan (the plan round checks it). ``bar``: the job's
    progress when this gather is one part of it (else one of its own, per ``opts``)."""
    own_bar = bar is None
    if bar is None:
        bar = Progress(call, opts.progress, plan_bytes(plan), f"shardgather: {call.what}")
    else:
        bar.part(plan_bytes(plan))
    try:
        way = route(call, plan, sink, opts)
        move(call, plan, sink, opts, way, bar)
        result = finish(call, sink)
        bar.done()
        return result
    except BaseException as exc:
        call.latch(exc)  # before the cleanup: a peer must find our error, not its effect
        sink.abort(call)
        raise
    finally:
        if own_bar:
            bar.close()


def plan_bytes(plan: GatherPlan) -> int:
    """The bytes a gather of ``plan`` moves: every entry once, in its target dtype."""
    return sum(e.nbytes for e in plan.entries.values())


@dataclass
class Route:
    """What the plan round settled: the transport, and who does what in it."""

    local: bool  # node-local (else collective)
    remote: list[int]  # ranks that send their pieces to rank 0
    writes_pieces: bool  # this rank writes its own pieces to the sink's targets
    receives: bool  # this rank receives (whole entries, buckets, messages)
    group: Any  # the data group, where host bytes travel (None: not needed)
    buckets: list[list[Bucket]]  # per phase of the plan (collective)

    def participating(self, plan: GatherPlan) -> Callable[[int], bool]:
        # rank0_only: only the shard groups holding rank 0 take part (one HSDP replica)
        return lambda i: 0 in plan.sources[i].group_ranks


def route(call: Call, plan: GatherPlan, sink: Sink, opts: Options) -> Route:
    """Choose the transport and set the sink up, with the plan round: rank 0 decides
    (it alone knows its free shared memory and which shard groups take part) and
    prepares the sink (regions, temporary files); the round agrees on the plan and
    hands rank 0's choice and names to everyone, who then open what rank 0 made."""
    is_dict = sink.into_memory
    why: str | None = "collective"
    if opts.transport != Transport.COLLECTIVE:
        why = node_local.unusable_because(
            plan, opts.rank0_only, need_contiguous=sink.pieces_need_contiguous, into_memory=is_dict
        )
        if why is None and is_dict and opts.pin_memory:
            why = "pin_memory=True"
    hosts: list[str] = []
    memfd = False
    if why is None and call.rank == 0:
        hosts = node_local.host_ids(call)
    if why is None and is_dict:  # every rank alike (same plan, same options)
        memfd = node_local.memfd_shareable(call, hosts)
    payload = None
    if call.rank == 0:
        if why is None and is_dict and not memfd:
            free, need = node_local.shm_free_bytes(), sink.shm_bytes
            if free < need + 64 * 2**20:
                why = f"{node_local.SHM_DIR} has {free >> 20} MiB free, {need >> 20} MiB needed"
        senders = []
        if why is None and not opts.shared_filesystem:
            senders = node_local.remote_ranks(
                plan, hosts, lambda i: 0 in plan.sources[i].group_ranks
            )
        payload = (why, sink.prepare(call, why is None, memfd), senders, hosts[:1])
    why, handoff, remote, host0 = call.round(
        "plan",
        same=plan.fingerprint,
        payload=payload,
        gather="rank0",
        agree=getattr(sink, "agreed", None),
    )
    local = why is None
    # Nothing sharded means nothing to move either way: no fallback worth a warning.
    sharded = any(s.group is not None for s in plan.sources)
    if not local and opts.transport == Transport.NODE_LOCAL and sharded:
        node_local.warn_once(
            f"shardgather: node-local transport unavailable ({why}); using collectives"
        )
    mb = opts.bucket_bytes(on_cuda(plan)) / 2**20
    buckets = [
        [] if local else my_buckets(plan, mb, opts.rank0_only, phase.sources)
        for phase in plan.phases_or_one()
    ]
    group = None
    if (local and remote) or (not local and host_buckets(plan)):
        group = data_group(call)
    same_host = opts.shared_filesystem or not host0 or _dist.host_id() == host0[0]
    writes_pieces = local and call.rank not in remote and same_host
    sink.open(call, local, handoff, writes_pieces)
    receives = call.rank == 0 if local else (not opts.rank0_only or call.rank == 0)
    return Route(local, remote, writes_pieces, receives, group, buckets)


def move(
    call: Call, plan: GatherPlan, sink: Sink, opts: Options, way: Route, bar: Progress
) -> None:
    """The data phase, then each rank flushes its own writes. A plan in phases moves
    them in order, each after its step (every rank takes every step, whatever it
    holds: the steps are collective)."""
    message_bytes = opts.bucket_bytes(on_cuda(plan))
    by_source = plan.entries_by_source()
    for phase, buckets in zip(plan.phases_or_one(), way.buckets):
        if phase.prepare is not None:
            phase.prepare(call)
        if way.receives:
            for e in plan.entries.values():
                if e.source.group is None and e.source.index in phase.sources:
                    sink.write_whole(e)  # held whole by every rank: no transport
                    if call.rank == 0:
                        bar.update(e.nbytes)
        if way.local:
            _move_pieces(call, plan, sink, way, bar, message_bytes, phase.sources)
        else:
            for bucket, rows in gather_buckets(
                call, buckets, lambda b: way.receives, to_one=opts.rank0_only, group=way.group
            ):
                if rows is not None:
                    parts = bucket_parts(bucket, by_source)
                    sink.write_rows(rows, parts)
                    if call.rank == 0:
                        bar.update(sum(p.nbytes for p in parts))
    if way.local:
        bar.report(last=True)
        if call.rank == 0:
            bar.watch_others()  # the ranks writing their own pieces beside rank 0
    sink.flush()


def _move_pieces(
    call: Call,
    plan: GatherPlan,
    sink: Sink,
    way: Route,
    bar: Progress,
    message_bytes: int,
    sources: frozenset[int],
) -> None:
    """Node-local: this rank's pieces of ``sources`` to their places (or to rank 0,
    from another host); rank 0 takes the other hosts' pieces."""
    participating = way.participating(plan)

    def taken(i: int) -> bool:
        return i in sources and participating(i)

    mine = pieces_of(plan, taken)
    if call.rank in way.remote:
        send_pieces(call, mine, message_bytes, way.group)
    elif way.writes_pieces:
        # With a bar, in batches, each counted; without, in one go (no change)
        for batch in _batches(mine) if bar.enabled else [mine]:
            write_pieces(batch, sink.target, sink.direct_fd)
            bar.update(_piece_bytes(batch))
    if call.rank == 0:
        for sender in way.remote:
            theirs = pieces_of(plan, taken, sender)
            receive_pieces(call, sender, theirs, message_bytes, way.group, sink)
            bar.update(_piece_bytes(theirs))


def _piece_bytes(pieces: list[Any]) -> int:
    return sum(pc.numel * pc.entry.target_dtype.itemsize for pc in pieces)


def _batches(pieces: list[Any], nbytes: int = 64 << 20) -> Iterator[list[Any]]:
    """``pieces`` in runs of about ``nbytes`` (a progress report after each)."""
    batch: list[Any] = []
    size = 0
    for pc in pieces:
        batch.append(pc)
        size += pc.numel * pc.entry.target_dtype.itemsize
        if size >= nbytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def finish(call: Call, sink: Sink) -> Any:
    """The done round (every rank's data is in place), then the sink's result; a file
    is published by rank 0 and agreed on (it exists for everyone once this returns)."""
    call.round("done")
    result = sink.finish(call)
    if sink.publishes:
        call.round("published")
    return result


def stream(
    call: Call,
    plan: GatherPlan,
    opts: Options,
    copy_out: Callable[[torch.Tensor, list[Any]], list[tuple[str, torch.Tensor]]],
    whole: Callable[[Any], torch.Tensor],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The collective transport as a stream: yields ``(key, tensor)`` as buckets
    complete them. One buffer pair: bucket k+1 is launched as soon as bucket k is copied
    out (``copy_out(rows, parts)``, which returns the entries it completed), so it is in
    flight while the consumer handles bucket k, and gathered rows never outlive their
    copy-out. ``whole(entry)`` makes an entry every rank holds in full."""
    receives = not opts.rank0_only or call.rank == 0
    mb = opts.bucket_bytes(on_cuda(plan)) / 2**20
    phases = plan.phases_or_one()
    per_phase = [my_buckets(plan, mb, opts.rank0_only, ph.sources) for ph in phases]
    call.round("plan", same=plan.fingerprint)
    group = data_group(call) if host_buckets(plan) else None
    buckets = [b for bs in per_phase for b in bs]
    gathers = BucketGathers(
        call, buckets, lambda b: receives, to_one=opts.rank0_only, group=group, slots=1
    )
    by_source = plan.entries_by_source()
    first = 0  # index of the phase's first bucket in ``buckets``
    for phase, mine in zip(phases, per_phase):
        if phase.prepare is not None:
            phase.prepare(call)
        if mine:
            gathers.launch(first)
        if receives:
            for key, e in plan.entries.items():
                if e.source.group is None and e.source.index in phase.sources:
                    yield key, whole(e)
        for i in range(first, first + len(mine)):
            rows = gathers.wait(i)
            done = copy_out(rows, bucket_parts(buckets[i], by_source)) if rows is not None else []
            if i + 1 < first + len(mine):
                gathers.launch(i + 1)
            yield from done
        first += len(mine)
    call.round("done")


def gather_to_all(call: Call, plan: GatherPlan, bucket_mb: float) -> dict[str, torch.Tensor]:
    """Every entry of ``plan`` whole on every rank, as one step of the call in progress
    (a phase's ``prepare``: a merged export's LoRA factors): the collective transport
    into a host dict of fresh tensors. Collective over every rank of the plan's groups."""
    sink = HostDict(plan, receives=True)
    sink.open(call, node_local=False, handoff=None, writes_pieces=False)
    for e in plan.entries.values():
        if e.source.group is None:
            sink.write_whole(e)
    buckets = my_buckets(plan, bucket_mb, rank0_only=False)
    group = data_group(call) if host_buckets(plan) else None
    by_source = plan.entries_by_source()
    for bucket, rows in gather_buckets(call, buckets, lambda b: True, to_one=False, group=group):
        assert rows is not None
        sink.write_rows(rows, bucket_parts(bucket, by_source))
    out = sink.finish(call)
    assert out is not None
    return out
