"""DTensor layouts — tensor parallel, FSDP2 on any mesh (1-D, HSDP, with TP), expert
parallel, ``Shard(d)`` on any dim: which elements of the full tensor each rank's local
tensor holds, as blocks of the plan.

Derived from the mesh and the placements with torch's own per-placement rule (the
global index lists DTensor computes for checkpoints: ``Shard``'s torch.chunk split,
``_StridedShard``'s right-to-left interleave), so a new placement is data, not code:
per tensor dim, the global indices each local index maps to, cut into ranges; their
product, boxes; each box, blocks (runs strided on both sides, ``_layout.Block``). The
ranks whose coordinates differ only on ``Replicate`` dims hold the same elements: one
replica (the ranks at this rank's coordinate on those dims) is the source's group.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._layout import Block
from ..errors import UnsupportedModelError
from .types import Source, contiguous_stride

# Along one tensor dim: (global start, local start, length) of consecutive indices.
Ranges = tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class MeshGroup:
    """The ranks holding the distinct blocks of an N-D source (its sharded mesh dims, at
    this rank's coordinate on the replicated ones) where no process group of torch's
    spans exactly them. Host rows never need one (they travel on shardgather's own data
    group, by global rank); device rows get one on first use (:func:`process_group`)."""

    ranks: tuple[int, ...]


_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def process_group(group: object, ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """A torch process group over ``ranks`` for a device all-gather: the source's own,
    or one made once per rank set. Made with ``use_local_synchronization``: only its
    members call it, each at the same point of the same plan (identical on every rank),
    so they create their groups in the same order."""
    if isinstance(group, dist.ProcessGroup):
        return group
    if ranks not in _GROUPS:
        _GROUPS[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _GROUPS[ranks]


def is_dtensor(t: object) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def _placement_types() -> tuple[type, type, type]:
    from torch.distributed.tensor.placement_types import Replicate, Shard

    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # pragma: no cover - torch before _StridedShard
        _StridedShard = Shard
    return Shard, _StridedShard, Replicate


def is_sharding(placement: object) -> bool:
    shard, strided, _ = _placement_types()
    return isinstance(placement, (shard, strided))


@functools.lru_cache(maxsize=4096)
def dim_ranges(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coord: tuple[int, ...],
    placements: tuple[object, ...],
) -> tuple[Ranges, ...] | None:
    """Per dim of a tensor of ``shape``, the ranges of global indices that the local
    tensor at mesh coordinate ``coord`` holds, in local order (None: it holds nothing).

    Cached: every layer of a model repeats the same few (shape, coordinate) pairs.
    """
    try:
        from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    except ImportError:  # pragma: no cover - older torch: each placement's first offset
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

        local, offset = _compute_local_shape_and_global_offset(
            shape, mesh_shape, list(coord), list(placements)
        )
        if 0 in local:
            return None
        return tuple(((o, 0, n),) for o, n in zip(offset, local))
    index: dict[int, torch.Tensor] = {}
    local = list(shape)
    for mesh_dim, placement in enumerate(placements):
        if not is_sharding(placement):
            continue
        d = placement.dim % len(shape)  # type: ignore[attr-defined]
        size, idx = _get_shard_size_and_offsets(
            local[d],
            mesh_shape[mesh_dim],
            coord[mesh_dim],
            placement,
            index.get(d),
            shape[d],
            False,
        )
        if size == 0:
            return None
        local[d] = int(size)
        index[d] = idx
    out = []
    for d, n in enumerate(shape):
        if n == 0:
            return None
        idx = index.get(d)
        out.append(((0, 0, n),) if idx is None else _runs_of(idx))
    return tuple(out)


def _runs_of(idx: torch.Tensor) -> Ranges:
    """Consecutive stretches of a 1-D index tensor, as (global, local, length)."""
    idx = idx.reshape(-1).to(torch.int64)
    breaks = ((idx[1:] - idx[:-1]) != 1).nonzero().reshape(-1) + 1
    starts = [0, *breaks.tolist()]
    ends = [*starts[1:], idx.numel()]
    firsts = idx[torch.tensor(starts)].tolist()
    return tuple((g, a, b - a) for g, a, b in zip(firsts, starts, ends))


def box_blocks(
    shape: tuple[int, ...],
    local_shape: tuple[int, ...],
    box: Sequence[tuple[int, int, int]],
    row_start: int,
) -> list[Block]:
    """The elements of one box (per dim: global start, local start, length) of a
    contiguous full tensor of ``shape``, held in a contiguous local tensor of
    ``local_shape`` whose first element is at flat position ``row_start``: as blocks of
    runs, innermost dims merged where both sides are contiguous, the outermost dims
    that cannot merge enumerated (a box partial in three or more dims)."""
    gstride, lstride = contiguous_stride(shape), contiguous_stride(local_shape)
    g0 = sum(g * s for (g, _, _), s in zip(box, gstride))
    l0 = sum(a * s for (_, a, _), s in zip(box, lstride))
    dims = [(n, gs, ls) for (_, _, n), gs, ls in zip(box, gstride, lstride) if n != 1]
    if any(n == 0 for n, _, _ in dims):
        return []
    run = 1
    while dims and dims[-1][1] == run and dims[-1][2] == run:
        run *= dims.pop()[0]
    if not dims:
        return [Block(row_start + l0, g0, run)]
    count, fs, ss = dims.pop()
    while dims and dims[-1][1] == count * fs and dims[-1][2] == count * ss:
        count *= dims.pop()[0]
    blocks = []
    for outer in itertools.product(*(range(n) for n, _, _ in dims)):
        dg = sum(i * gs for i, (_, gs, _) in zip(outer, dims))
        dl = sum(i * ls for i, (_, _, ls) in zip(outer, dims))
        blocks.append(Block(row_start + l0 + dl, g0 + dg, count * run, run, ss, fs))
    return blocks


@dataclass
class Layout:
    """Where a DTensor's elements are: the group (one replica) and every row's blocks."""

    group: object  # a ProcessGroup, a MeshGroup, or None (every rank holds it whole)
    ranks: tuple[int, ...]  # the group's global ranks, in row order
    row: int  # this rank's row
    row_numel: int
    blocks: tuple[Block, ...]  # every row's, in flat (rank-major) order
    classic: bool  # the rows are the full tensor in order: one run from 0 (FSDP2 dim-0)


def replica(grid: torch.Tensor, coord: Sequence[int], sharded: Sequence[int]) -> list[int]:
    """The ranks of ``grid`` (the mesh's rank tensor) that share ``coord`` on every
    dim but the ``sharded`` ones: one replica of a DTensor's elements."""
    index = tuple(slice(None) if d in sharded else coord[d] for d in range(grid.ndim))
    return [int(r) for r in grid[index].reshape(-1).tolist()]


def coordinate(grid: torch.Tensor, rank: int) -> tuple[int, ...]:
    return tuple(int(c) for c in (grid == rank).nonzero()[0].tolist())


def rows_layout(
    key: str,
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coords: Sequence[tuple[int, ...]],
    placements: tuple[object, ...],
    row_numel: int | None = None,
) -> tuple[int, tuple[Block, ...], bool, tuple[tuple[int, ...], ...]]:
    """Every row's blocks, row ``j`` being the rank at mesh coordinate ``coords[j]``,
    each holding its local tensor contiguous at the start of its row (padded to
    ``row_numel``; None: the largest local tensor). Pure: no process group needed.

    Returns:
        (row numel, blocks in flat order, whether the layout is classic, local shapes).

    Raises:
        UnsupportedModelError: the local tensors do not tile the full tensor exactly once.
    """
    try:
        return _rows_layout(tuple(shape), mesh_shape, tuple(coords), placements, row_numel)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{key!r}: {exc}") from None


@functools.lru_cache(maxsize=1024)
def _rows_layout(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coords: tuple[tuple[int, ...], ...],
    placements: tuple[object, ...],
    row_numel: int | None,
) -> tuple[int, tuple[Block, ...], bool, tuple[tuple[int, ...], ...]]:
    # Cached: every layer repeats the same few shapes, and a plan is built every call.
    per_row = []
    for c in coords:
        ranges = dim_ranges(tuple(shape), mesh_shape, tuple(c), placements)
        lshape = (
            tuple(sum(n for _, _, n in rs) for rs in ranges)
            if ranges is not None
            else (0,) * len(shape)
        )
        per_row.append((ranges, lshape))
    p = row_numel if row_numel is not None else max(math.prod(ls) for _, ls in per_row)
    blocks: list[Block] = []
    for j, (ranges, lshape) in enumerate(per_row):
        if ranges is None:
            continue
        if math.prod(lshape) > p:
            raise UnsupportedModelError(
                f"row {j}'s local tensor {lshape} does not fit its row of {p}"
            )
        for box in itertools.product(*ranges):
            blocks.extend(box_blocks(tuple(shape), lshape, box, j * p))
    _check_tiling(placements, math.prod(shape), blocks)
    classic = all(b.contiguous and b.shard == b.full for b in blocks) and _rows_start_at_row(
        blocks, max(p, 1)
    )
    return p, tuple(blocks), classic, tuple(ls for _, ls in per_row)


# layout_of's results for the meshes this process saw: a plan is rebuilt at every call
# (the model may have changed), and without this the mesh walk was most of building one —
# 54 of 0.27 s per weight sync of a 231-parameter FSDP2 model. Keyed by the mesh object
# and the default group (a new one after destroy/init means new ranks), both kept alive
# in the value so their ids are not reused; cleared when it grows past a few models' worth.
_LAYOUTS: dict[tuple[object, ...], tuple[object, object, Layout]] = {}


def layout_of(
    key: str,
    shape: tuple[int, ...],
    mesh: object,
    placements: Sequence[object],
    local_shape: tuple[int, ...],
    row_numel: int | None = None,
) -> Layout:
    """The layout of a DTensor of global ``shape`` on ``mesh`` with ``placements`` whose
    local tensor here has ``local_shape``, contiguous at the start of its row (padded to
    ``row_numel`` elements on every rank; None: the largest local tensor).

    Raises:
        UnsupportedModelError: a placement that is neither Shard, _StridedShard nor
            Replicate (Partial: a pending reduction is not a value), or local tensors
            that do not tile the full tensor exactly once.
    """
    world = dist.group.WORLD if dist.is_initialized() else None
    memo = (id(mesh), id(world), tuple(shape), tuple(placements), tuple(local_shape), row_numel)
    hit = _LAYOUTS.get(memo)
    if hit is not None and hit[0] is mesh and hit[1] is world:
        return hit[2]
    if len(_LAYOUTS) > 4096:
        _LAYOUTS.clear()
    _, _, replicate = _placement_types()
    placements = tuple(placements)
    for p in placements:
        if not (is_sharding(p) or isinstance(p, replicate)):
            raise UnsupportedModelError(
                f"{key!r} is a DTensor with placement {p} (placements {placements}); "
                "shardgather takes Shard, _StridedShard and Replicate placements. A Partial "
                "placement holds a pending reduction, not a value: redistribute it first."
            )
    grid = mesh.mesh  # type: ignore[attr-defined]
    coord = tuple(mesh.get_coordinate())  # type: ignore[attr-defined]
    sharded = [d for d, p in enumerate(placements) if is_sharding(p)]
    numel = math.prod(shape)
    if not sharded:
        lay = Layout(None, (dist.get_rank(),), 0, numel, (Block(0, 0, numel),), True)
        _LAYOUTS[memo] = (mesh, world, lay)
        return lay
    members = replica(grid, coord, sharded)
    group: object
    if len(sharded) == 1:
        group = mesh.get_group(sharded[0])  # type: ignore[attr-defined]
        ranks = tuple(dist.get_process_group_ranks(group))
    else:
        ranks = tuple(sorted(members))  # new_group's order, for a device group
        group = MeshGroup(ranks)
    if sorted(ranks) != sorted(members):  # pragma: no cover - a mesh torch would refuse
        raise UnsupportedModelError(f"{key!r}: the mesh's group does not hold its replica")
    coords = [coordinate(grid, r) for r in ranks]
    me = ranks.index(dist.get_rank())
    p, blocks, classic, shapes = rows_layout(
        key, tuple(shape), tuple(grid.shape), coords, placements, row_numel
    )
    if shapes[me] != tuple(local_shape) and math.prod(local_shape) + math.prod(shapes[me]):
        raise UnsupportedModelError(
            f"{key!r}: its local tensor is {tuple(local_shape)} here, but its placements "
            f"{placements} on a mesh of shape {tuple(grid.shape)} give {shapes[me]}: "
            "shardgather cannot tell which elements it holds."
        )
    lay = Layout(group, ranks, me, p, blocks, classic)
    _LAYOUTS[memo] = (mesh, world, lay)
    return lay


def _rows_start_at_row(blocks: list[Block], p: int) -> bool:
    """Each row holds one run from its start (so the rows concatenated are the tensor)."""
    rows = [b.shard // p for b in blocks]
    return len(set(rows)) == len(rows) and all(b.shard % p == 0 for b in blocks)


def _check_tiling(placements: tuple[object, ...], numel: int, blocks: list[Block]) -> None:
    """Every element of the full tensor in exactly one block of one row: the runs,
    sorted, must not overlap, stay in bounds and add up to the tensor (vectorised:
    row-wise TP of a large matrix has tens of thousands of runs)."""
    covered = sum(b.numel for b in blocks)
    ok = covered == numel
    if ok and blocks:
        starts = torch.cat(
            [b.full + torch.arange(b.count, dtype=torch.int64) * b.strides[1] for b in blocks]
        )
        lens = torch.cat([torch.full((b.count,), b.run_numel, dtype=torch.int64) for b in blocks])
        order = starts.argsort()
        starts, lens = starts[order], lens[order]
        ends = starts + lens
        ok = bool(starts[0] >= 0) and int(ends[-1]) <= numel
        ok = ok and bool((starts[1:] >= ends[:-1]).all())
    if not ok:
        raise UnsupportedModelError(
            f"the local tensors its placements {placements} describe do not hold each of its "
            f"{numel} elements exactly once (they hold {covered}); shardgather needs every "
            "element held by exactly one rank of a replica."
        )


def source_of(
    key: str,
    dt: object,
    sources: list[Source],
    *,
    local: Callable[[], torch.Tensor],
    storage: Callable[[], torch.Tensor] | None,
    row_numel: int | None = None,
    description: str = "",
) -> tuple[Source, tuple[Block, ...] | None]:
    """A source for a DTensor ``dt`` (a parameter, FSDP2's sharded parameter, a buffer):
    its row is ``local()`` (this rank's local tensor, flat), written in place through
    ``storage()``. Returns the source and the entry's blocks (None: the classic layout,
    one run from 0)."""
    lt = dt.to_local()  # type: ignore[attr-defined]
    if lt.numel() > 0 and not lt.is_contiguous():
        raise UnsupportedModelError(
            f"{key!r}: its DTensor's local tensor is not contiguous (strides {lt.stride()}); "
            "shardgather reads local tensors as contiguous blocks"
        )
    lay = layout_of(
        key,
        tuple(dt.shape),  # type: ignore[attr-defined]
        dt.device_mesh,  # type: ignore[attr-defined]
        dt.placements,  # type: ignore[attr-defined]
        tuple(lt.shape),
        row_numel,
    )
    src = Source(
        index=len(sources),
        group=lay.group,  # type: ignore[arg-type]
        world=len(lay.ranks) if lay.group is not None else 1,
        rank=lay.row,
        row_numel=lay.row_numel,
        dtype=lt.dtype,
        local=local,
        group_ranks=lay.ranks if lay.group is not None else (),
        description=description or f"DTensor {key} {tuple(dt.placements)}",  # type: ignore[attr-defined]
        storage=storage,
        device=lt.device,
    )
    sources.append(src)
    return src, None if lay.classic else lay.blocks
