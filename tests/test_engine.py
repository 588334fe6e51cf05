"""The in-process tier: plans built from metadata (``fake_plans``), and the engine's
scheduling and copy paths run on them rank by rank, in one process — buckets and parts
(the collective transport), pieces (node-local), messages (other hosts), load ranges —
bit-exact against the plain tensors. No FSDP, no process group: what these cover, the
multi-process tier does not need to."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

import shardgather as sg
from shardgather import _dist
from shardgather._engine import load as engine_load
from shardgather._engine import staging
from shardgather._engine.buckets import bucket_parts, build_buckets, my_buckets
from shardgather._engine.collective import pack_row
from shardgather._engine.pieces import Rows, message_size, messages, pieces_of, write_pieces
from shardgather._engine.remote import pack_message
from shardgather._engine.sinks import Files, HostDict, file_set
from shardgather._plan import own_blocks
from shardgather._plan.merge import merged
from shardgather._plan.subset import select

from . import fake_plans
from .fake_plans import Sharded

SHAPES = st.lists(
    st.tuples(st.integers(0, 9), st.integers(1, 5)), min_size=1, max_size=5
)  # dim 0 may be 0 (empty params) or smaller than the world (empty shards)


def _mesh2(world: int) -> tuple[int, int]:
    return (2, world // 2) if world % 2 == 0 else (1, world)


def _tp_rowwise(shapes, world, **kw):  # type: ignore[no-untyped-def]
    """Tensor parallel, row-wise (Shard(1)): every rank holds a column slice — runs."""
    return fake_plans.nd(shapes, (world,), (Shard(1),), **kw)


def _fsdp2_tp(shapes, world, **kw):  # type: ignore[no-untyped-def]
    """FSDP2 over column-wise TP: _StridedShard(0) on dp, Shard(0) on tp (the rows of a
    rank's block are not where its row falls in rank order)."""
    mesh = _mesh2(world)
    return fake_plans.nd(shapes, mesh, (_StridedShard(0, split_factor=mesh[1]), Shard(0)), **kw)


def _dp_rowwise(shapes, world, **kw):  # type: ignore[no-untyped-def]
    """FSDP2 dim-0 over row-wise TP: a box per rank (rows of dp, columns of tp)."""
    return fake_plans.nd(shapes, _mesh2(world), (Shard(0), Shard(1)), **kw)


def _replicated_tp(shapes, world, **kw):  # type: ignore[no-untyped-def]
    """TP replicated over a data-parallel dim (DDP / HSDP's replicas): two replicas,
    one group each."""
    return fake_plans.nd(shapes, _mesh2(world), (Replicate(), Shard(1)), **kw)


LAYOUTS = {
    "fsdp1": fake_plans.fsdp1,
    "fsdp2": fake_plans.fsdp2,
    "tp-rowwise": _tp_rowwise,
    "fsdp2xtp": _fsdp2_tp,
    "dp-rowwise": _dp_rowwise,
    "replicated-tp": _replicated_tp,
}


def _expected(s: Sharded, key: str, out_dtype: torch.dtype | None) -> torch.Tensor:
    t = s.fulls[key]
    return t.to(out_dtype) if out_dtype is not None and t.is_floating_point() else t


def _gather_in_process(s: Sharded, bucket_bytes: int) -> dict[str, torch.Tensor]:
    """The collective transport, simulated: every rank packs its row of each bucket
    (the real packing), the rows are stacked as a gather would, and rank 0's sink
    copies them out (the real copy-out)."""
    plan0 = s.plans[0]
    sink = HostDict(plan0, receives=True)
    sink.open(None, False, None, False)  # type: ignore[arg-type]
    for e in plan0.entries.values():
        if e.source.group is None:
            sink.write_whole(e)
    per_rank = [build_buckets(p.sources, bucket_bytes, p.columns) for p in s.plans]
    by_source = plan0.entries_by_source()
    for i, b in enumerate(per_rank[0]):
        rows = torch.zeros(b.world, b.row_bytes, dtype=torch.uint8)
        for j, r in enumerate(b.ranks):  # the group's ranks (one replica), in row order
            plan = s.plans[r]
            mine = per_rank[r][i]
            assert (mine.row_bytes, len(mine.chunks)) == (b.row_bytes, len(b.chunks))
            pack_row(mine, rows[j], lambda src, plan=plan: plan.sources[src.index].local())
        sink.write_rows(rows, bucket_parts(b, by_source))
    assert sink.outputs is not None
    return sink.outputs


@settings(max_examples=60, deadline=None)
@given(
    layout=st.sampled_from(sorted(LAYOUTS)),
    shapes=SHAPES,
    world=st.integers(1, 4),
    bucket_bytes=st.sampled_from([16, 48, 100, 4096]),
    cast=st.booleans(),
)
def test_buckets_and_parts_deliver_every_element(layout, shapes, world, bucket_bytes, cast) -> None:  # type: ignore[no-untyped-def]
    out_dtype = torch.bfloat16 if cast else None
    s = LAYOUTS[layout](shapes, world, out_dtype=out_dtype)
    got = _gather_in_process(s, bucket_bytes)
    for key in s.fulls:
        want = _expected(s, key, out_dtype if key != "buf" else None)
        assert got[key].dtype == want.dtype and torch.equal(got[key], want), key
    # Each element arrives in exactly one part (tiny buckets split sources in chunks).
    plan = s.plans[0]
    counts = {k: 0 for k in plan.entries}
    for b in build_buckets(plan.sources, bucket_bytes):
        for p in bucket_parts(b, plan.entries_by_source()):
            counts[p.entry.key] += p.numel
    for key, e in plan.entries.items():
        if e.source.group is not None:
            assert counts[key] == e.numel, key


@settings(max_examples=40, deadline=None)
@given(
    layout=st.sampled_from(sorted(LAYOUTS)),
    shapes=SHAPES,
    world=st.integers(1, 4),
    cast=st.booleans(),
    slice_elements=st.sampled_from([1, 5, 1 << 20]),
    data=st.data(),
)
def test_merged_weights_are_added_where_each_rank_holds_them(
    layout, shapes, world, cast, slice_elements, data
) -> None:  # type: ignore[no-untyped-def]
    """merge_adapter='s placement, for every layout (FSDP1 flat rows, FSDP2 dim-0, row-
    and column-wise TP, FSDP2 x TP): each rank adds the delta rows its own elements of W
    cover, and the gathered result is W + delta, bit for bit, under the new names —
    whether a delta is added whole or a slice of rows at a time (``slice_elements``)."""
    from shardgather._plan import merge

    saved, merge.DELTA_ELEMENTS = merge.DELTA_ELEMENTS, slice_elements
    try:
        _check_merged_placement(layout, shapes, world, cast, data)
    finally:
        merge.DELTA_ELEMENTS = saved


def _check_merged_placement(layout, shapes, world, cast, data) -> None:  # type: ignore[no-untyped-def]
    s = LAYOUTS[layout](shapes, world, out_dtype=torch.bfloat16 if cast else None)
    two_d = [k for k in s.plans[0].keys if s.fulls[k].dim() == 2]
    if not two_d:
        return
    chosen = data.draw(st.lists(st.sampled_from(two_d), min_size=1, unique=True))
    g = torch.Generator().manual_seed(len(chosen))
    full_deltas = {k: torch.randn(tuple(s.fulls[k].shape), generator=g) for k in chosen}
    asked: dict[tuple[int, str], set[int]] = {}  # (rank, key) -> delta rows it asked for

    def delta(rank: int, k: str):  # type: ignore[no-untyped-def]
        def rows(r0: int, r1: int) -> torch.Tensor:
            asked.setdefault((rank, k), set()).update(range(r0, r1))
            return full_deltas[k][r0:r1].clone()

        return rows

    dropped = data.draw(st.sampled_from([k for k in s.plans[0].keys if k not in chosen] + [None]))
    plans = [
        merged(p, {k: delta(rank, k) for k in chosen}, {dropped} - {None}, lambda k: "m." + k)
        for rank, p in enumerate(s.plans)
    ]
    got = _gather_in_process(Sharded(plans, s.fulls, s.world), 48)
    assert sorted(got) == sorted("m." + k for k in s.plans[0].keys if k != dropped)
    for key in s.plans[0].keys:
        if key == dropped:
            continue
        want = s.fulls[key].float() + full_deltas[key] if key in chosen else s.fulls[key]
        if cast and want.is_floating_point():
            want = want.to(torch.bfloat16)
        elif key in chosen:
            want = want.to(s.fulls[key].dtype)
        assert torch.equal(got["m." + key], want), key
    # Each rank asked only for the delta rows its own elements of W lie in.
    for (rank, k), rows in asked.items():
        e, cols = s.plans[rank].entries[k], s.fulls[k].shape[1]
        mine = {
            row
            for b in own_blocks(e)
            for _, full, n in b.runs()
            for row in range(full // cols, (full + n - 1) // cols + 1)
        }
        assert rows <= mine, (rank, k, sorted(rows - mine))


@settings(max_examples=40, deadline=None)
@given(
    layout=st.sampled_from(sorted(LAYOUTS)),
    shapes=SHAPES,
    world=st.integers(1, 4),
    bucket_bytes=st.sampled_from([16, 48, 4096]),
    data=st.data(),
)
def test_a_subset_gathers_its_keys_from_their_columns_only(
    layout, shapes, world, bucket_bytes, data
) -> None:  # type: ignore[no-untyped-def]
    """keys=: every rank selects the same keys; the buckets carry only the columns the
    kept entries occupy (an adapter's, not the flat parameter around it) and deliver
    each kept key bit-exactly."""
    s = LAYOUTS[layout](shapes, world)
    keys = data.draw(st.lists(st.sampled_from(s.plans[0].keys), min_size=1, unique=True))
    sub = Sharded([select(p, keys) for p in s.plans], s.fulls, s.world)
    got = _gather_in_process(sub, bucket_bytes)
    assert sorted(got) == sorted(keys)
    for key in keys:
        assert torch.equal(got[key], s.fulls[key]), key
    plan, subplan = s.plans[0], sub.plans[0]
    whole = build_buckets(plan.sources, bucket_bytes)
    part = build_buckets(subplan.sources, bucket_bytes, subplan.columns)
    slack = sum(16 * b.world * len(b.chunks) for b in part)  # each chunk's alignment
    assert sum(b.nbytes for b in part) <= sum(b.nbytes for b in whole) + slack
    kept = sum(e.numel * e.dtype.itemsize for e in subplan.entries.values() if e.source.group)
    if not kept:
        assert part == []


@settings(max_examples=60, deadline=None)
@given(layout=st.sampled_from(sorted(LAYOUTS)), shapes=SHAPES, world=st.integers(1, 4))
def test_the_pieces_of_all_ranks_tile_every_entry(layout, shapes, world) -> None:  # type: ignore[no-untyped-def]
    s = LAYOUTS[layout](shapes, world)
    for key, e in s.plans[0].entries.items():
        if e.source.group is None:
            continue
        covered = torch.zeros(e.numel, dtype=torch.int32)
        flat = s.fulls[key].reshape(-1)
        for r, plan in enumerate(s.plans):
            if 0 not in plan.entries[key].source.group_ranks:
                continue  # another replica: the same elements again
            # Any rank's pieces are known to every rank of its group, from the plan alone.
            assert [(p.entry.key, p.block) for p in pieces_of(s.plans[0], lambda i: True, r)] == [
                (p.entry.key, p.block) for p in pieces_of(plan, lambda i: True)
            ]
            rows = Rows()
            for pc in pieces_of(plan, lambda i: True):
                if pc.entry.key != key:
                    continue
                for _, full, n in pc.block.runs():
                    covered[full : full + n] += 1
                held = rows.held(pc.entry, pc.block).reshape(-1)
                want = torch.cat([flat[f : f + n] for _, f, n in pc.block.runs()])
                assert torch.equal(held, want), (key, r)
            # A rank's own blocks (what it loads) are its pieces, in source coordinates.
            start = plan.entries[key].source.rank * e.source.row_numel
            mine = [b.full for b in own_blocks(plan.entries[key])]
            theirs = [pc.dst_elem for pc in pieces_of(plan, lambda i: True) if pc.entry.key == key]
            assert mine == theirs and start >= 0, (key, r)
        assert bool((covered == 1).all()), key


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("cast", [False, True], ids=["same-dtype", "bf16"])
@pytest.mark.parametrize("io", ["page-cache", "direct", "direct-refused"])
def test_node_local_pieces_written_by_each_rank_make_the_file(tmp_path, layout, cast, io) -> None:  # type: ignore[no-untyped-def]
    out_dtype = torch.bfloat16 if cast else None
    # Big enough for blocks of O_DIRECT in the middle of pieces; a bf16 tensor of odd
    # size first, so later tensors start at offsets that are not even element-aligned
    # to 4 bytes, let alone to blocks.
    shapes = [(7, 3), (1, 4), (0, 2), (3001, 7), (5, 5), (4099, 3)]
    s = LAYOUTS[layout](shapes, 3, out_dtype=out_dtype)
    fs = file_set(s.plans[0], tmp_path / "m.safetensors")
    sink = Files(fs, what="test")
    handoff = sink.prepare(None, True, False)  # type: ignore[arg-type]
    sink.open(_OneRank(0), True, handoff, True)  # type: ignore[arg-type]
    for e in s.plans[0].entries.values():
        if e.source.group is None:
            sink.write_whole(e)
    direct = None
    if io == "direct":
        direct = sink.direct_fd
    elif io == "direct-refused":  # the device refuses: what failed goes through the cache
        refusing = os.open(fs.final + ".ro", os.O_RDONLY | os.O_CREAT, 0o600)
        direct = lambda fd: refusing  # noqa: E731
    for plan in s.plans:  # each "rank" pwrites its own pieces, as node-local does
        write_pieces(pieces_of(plan, lambda i: True), sink.target, direct)
    if io == "direct-refused":
        os.close(refusing)
        os.unlink(fs.final + ".ro")
    sink.flush()
    sink.finish(_OneRank(0))  # type: ignore[arg-type]
    got = sg.load_file(tmp_path / "m.safetensors")
    for key in s.fulls:
        want = _expected(s, key, out_dtype if key != "buf" else None)
        assert torch.equal(got[key], want), key
    assert os.listdir(tmp_path) == ["m.safetensors"]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("message_bytes", [16, 64, 2**20], ids=["tiny", "small", "one"])
def test_messages_from_other_hosts_reach_the_sink(layout, message_bytes) -> None:  # type: ignore[no-untyped-def]
    s = LAYOUTS[layout]([(6, 5), (2, 3), (9, 1)], 2, out_dtype=torch.float16)
    sink = HostDict(s.plans[0], receives=True)
    sink.open(None, False, None, False)  # type: ignore[arg-type]
    for e in s.plans[0].entries.values():
        if e.source.group is None:
            sink.write_whole(e)
    for r, plan in enumerate(s.plans):
        # Only rank 0's replica sends (the engine's rank0_only participation).
        ours = lambda i, plan=plan: 0 in plan.sources[i].group_ranks  # noqa: E731
        sent = messages(pieces_of(plan, ours), message_bytes)
        # The receiver derives the same messages from the plan (only payload travels).
        assert [[(p.entry.key, p.block) for p in m] for m in sent] == [
            [(p.entry.key, p.block) for p in m]
            for m in messages(pieces_of(s.plans[0], lambda i: True, r), message_bytes)
        ]
        rows = Rows()  # rank r's rows: its messages' parts are of its own plan's entries
        for parts in sent:
            assert message_size(parts) <= max(message_bytes, 64)
            buf = torch.empty(message_size(parts), dtype=torch.uint8)
            payload = pack_message(parts, buf, rows)
            sink.write_rows(payload.view(1, -1), parts)
    assert sink.outputs is not None
    for key in s.fulls:
        want = _expected(s, key, torch.float16 if key != "buf" else None)
        assert torch.equal(sink.outputs[key], want), key


class _OneRank:
    def __init__(self, rank: int) -> None:
        self.rank = rank


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_rank0_knows_every_ranks_load_range_from_the_plan_round(layout) -> None:
    s = LAYOUTS[layout]([(5, 2), (3, 3), (1, 1)], 3)
    for r, plan in enumerate(s.plans):
        rows = {src.index: src.rank for src in plan.sources if src.group is not None}
        for key, e in s.plans[0].entries.items():
            assert engine_load.blocks_for(e, rows) == own_blocks(plan.entries[key]), (key, r)


def test_buckets_hold_only_rank0s_groups_when_rank0_only() -> None:
    s = fake_plans.fsdp2([(4, 4)], 2)
    assert len(my_buckets(s.plans[1], 16, rank0_only=True)) == 1  # GROUP holds rank 0
    plan = s.plans[1]
    other = type(plan.sources[0])(**{**plan.sources[0].__dict__, "group_ranks": (2, 3)})
    plan.sources[0] = other
    assert my_buckets(plan, 16, rank0_only=True) == []


# ------------------------------------------------------------------ control plane, one rank


def test_one_rank_rounds_are_free_and_a_failure_is_raised_as_it_is() -> None:
    with _dist.Call("test", datetime.timedelta(seconds=5)) as call:
        assert call.round("a", payload=3, gather="rank0") == 3
        assert call.round("b", payload=3, gather="all") == [3]
        call.round("c", count=1)
        assert call.count == 1
    one_second = datetime.timedelta(seconds=1)
    with (
        pytest.raises(sg.CollectiveError, match="rank 0: ValueError: boom") as info,
        _dist.Call("test", one_second),
    ):
        raise ValueError("boom")
    assert isinstance(info.value.__cause__, ValueError)  # the traceback shows the cause
    with pytest.raises(sg.CheckpointError, match="bad"), _dist.Call("test", one_second):
        raise sg.CheckpointError("bad")  # ours: as it is


def test_the_agreed_error_keeps_a_common_class_and_names_every_rank() -> None:
    recs = [
        {"rank": 1, "type": "CheckpointError", "message": "bad header"},
        {"rank": 0, "type": "CheckpointError", "message": "bad header"},
    ]
    err = _dist.agreed_error("load", recs, [])
    assert type(err) is sg.CheckpointError and _dist.is_agreed(err)
    assert str(err).index("rank 0") < str(err).index("rank 1")
    mixed = _dist.agreed_error(
        "save", [*recs[:1], {"rank": 2, "type": None, "message": "OSError"}], []
    )
    assert type(mixed) is sg.CollectiveError
    missing = _dist.agreed_error("save", [], [3, 5])
    assert type(missing) is sg.CollectiveError and "ranks 3, 5 did not arrive" in str(missing)
    mism = _dist.agreed_error(
        "load",
        [{"rank": 0, "type": "StateDictMismatchError", "message": "m", "fields": [["a"], [], {}]}],
        [],
    )
    assert isinstance(mism, sg.StateDictMismatchError) and mism.missing_keys == ["a"]


def _subclasses(cls: type) -> list[type]:
    return [cls] + [s for c in cls.__subclasses__() for s in _subclasses(c)]


@pytest.mark.parametrize(
    "cls",
    [c for c in _subclasses(sg.ShardGatherError) if c.__module__.startswith("shardgather")],
    ids=lambda c: c.__name__,
)
def test_the_agreed_error_keeps_every_shardgather_class_wherever_it_is_defined(cls: type) -> None:
    """Regression: ConsumerError (defined beside the weight sync, not in errors.py) came
    back as CollectiveError on every rank that learnt of it from a peer."""
    record = _dist._failure_record(cls("a receiver refused"), 1)
    err = _dist.agreed_error("WeightSender.sync", [record], [])
    assert type(err) is cls, (type(err), record)
    # A name no class of ours has (another version's): CollectiveError, never a lookup
    # outside shardgather's errors.
    for name in ("os.system", "NoSuchError", "builtins.RuntimeError"):
        strange = _dist.agreed_error("x", [{"rank": 0, "type": name, "message": "m"}], [])
        assert type(strange) is sg.CollectiveError


def test_bad_timeouts_are_refused() -> None:
    with pytest.raises(sg.ShardGatherError, match="timeout"):
        sg.full_state_dict(torch.nn.Linear(2, 2), timeout=5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [
        {"in_flight": "later"},
        {"max_snapshot_mb": -1},
        {"write_mb_per_s": 0},
        {"shared_filesystem": "yes"},
    ],
    ids=str,
)
def test_save_options_are_validated_before_anything_happens(tmp_path, bad) -> None:  # type: ignore[no-untyped-def]
    """Every option is checked once, up front (in_flight took any value before)."""
    name = next(iter(bad))
    with pytest.raises(sg.ShardGatherError, match=name):
        sg.save_full_state_dict(torch.nn.Linear(2, 2), tmp_path / "m.safetensors", **bad)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ the pinned staging pool


def test_the_staging_pool_keeps_slabs_up_to_its_cap_and_releases(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Pinned memory needs CUDA; the pool's bookkeeping is the same on plain tensors.
    monkeypatch.setattr(staging, "_KEPT", [])
    monkeypatch.setenv("SHARDGATHER_PINNED_CACHE_MB", "1")
    made: list[int] = []

    def allocate(n: int) -> torch.Tensor:
        made.append(n)
        return torch.empty(n, dtype=torch.uint8)

    monkeypatch.setattr(staging, "_allocate", allocate)
    with staging.slabs(2) as lent:
        a = lent.get(0, 600_000)
        lent.get(1, 300_000)
        assert lent.get(0, 500_000).data_ptr() == a.data_ptr()  # fits: reused
        lent.get(0, 700_000)  # grows: the old slab goes back to the pool at the end
    assert staging.kept_bytes() <= 2**20  # the cap: the largest that fit, the rest freed
    assert staging.kept_bytes() == 700_000 + 300_000
    with staging.slabs(1) as lent:
        lent.get(0, 200_000)
    assert made == [600_000, 300_000, 700_000]  # the second call allocated nothing
    staging.release()
    assert staging.kept_bytes() == 0
