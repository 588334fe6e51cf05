"""Plans built from metadata alone, as every rank of a sharded model would build them —
without FSDP or processes: the in-process tier runs the engine's scheduling and copy
paths on them, rank by rank.

An FSDP1 layout is one flat parameter (the params back to back, padded to a multiple
of the world) whose rows are contiguous ranges; an FSDP2 layout gives every parameter
its own source, a padded dim-0 row range per rank (the last ranks' rows shorter or
empty, as FSDP2's are).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardgather._plan import Entry, GatherPlan, Source, contiguous_stride, fingerprint

GROUP = object()  # stands for a process group (the engine compares rows by their ranks)


@dataclass
class Sharded:
    plans: list[GatherPlan]  # what rank r builds (its own rows)
    fulls: dict[str, torch.Tensor]  # the plain model's tensors
    world: int


def _values(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


def _fulls(shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """The plain model: parameters p0, p1, ... of ``shapes``, and an int64 buffer."""
    g = torch.Generator().manual_seed(seed)
    fulls = {f"p{i}": _values(s, dtype, g) for i, s in enumerate(shapes)}
    fulls["buf"] = _values((3,), torch.int64, g)
    return fulls


def _plan(entries: list[Entry], sources: list[Source], rank: int, world: int) -> GatherPlan:
    keys = [e.key for e in entries]
    plan = GatherPlan(keys, {e.key: e for e in entries}, {}, sources, rank, world)
    plan.fingerprint = fingerprint(plan)
    return plan


def _local(t: torch.Tensor, key: str, index: int) -> tuple[Source, Entry]:
    src = Source(
        index,
        None,
        1,
        0,
        t.numel(),
        t.dtype,
        lambda t=t: t.reshape(-1),
        (0,),
        f"local {key}",
        storage=lambda t=t: t.reshape(-1),
    )
    return src, Entry(key, t.shape, contiguous_stride(t.shape), t.dtype, src, 0, is_buffer=True)


def fsdp1(
    shapes: list[tuple[int, ...]],
    world: int,
    dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype | None = None,
    seed: int = 0,
) -> Sharded:
    """One flat parameter of ``shapes`` plus one buffer, sharded over ``world`` ranks."""
    fulls = _fulls(shapes, dtype, seed)
    flat = torch.cat([fulls[f"p{i}"].reshape(-1) for i in range(len(shapes))])
    p = max(1, math.ceil(flat.numel() / world))
    padded = torch.zeros(p * world, dtype=dtype)
    padded[: flat.numel()] = flat
    rows = padded.view(world, p).clone()
    plans = []
    for r in range(world):
        src = Source(
            0,
            GROUP,
            world,
            r,
            p,
            dtype,
            lambda r=r: rows[r],
            tuple(range(world)),
            "flat",
            storage=lambda r=r: rows[r],
        )
        entries, base = [], 0
        for i, s in enumerate(shapes):
            e = Entry(f"p{i}", torch.Size(s), contiguous_stride(s), dtype, src, base)
            e.out_dtype = out_dtype
            entries.append(e)
            base += math.prod(s)
        bsrc, bentry = _local(fulls["buf"], "buf", 1)
        plans.append(_plan([*entries, bentry], [src, bsrc], r, world))
    return Sharded(plans, fulls, world)


def fsdp2(
    shapes: list[tuple[int, ...]],
    world: int,
    dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype | None = None,
    seed: int = 0,
) -> Sharded:
    """One source per parameter (padded dim-0 shards) plus one buffer."""
    fulls = _fulls(shapes, dtype, seed)
    rows: list[list[torch.Tensor]] = []  # [param][rank] padded row storage
    locals_: list[list[torch.Tensor]] = []  # [param][rank] the unpadded local shard
    for i, s in enumerate(shapes):
        per = math.ceil(s[0] / world) if s[0] else 0
        inner = math.prod(s[1:])
        row_numel = max(per * inner, 0)
        full = fulls[f"p{i}"]
        rs, ls = [], []
        for r in range(world):
            chunk = full[r * per : (r + 1) * per].reshape(-1)
            row = torch.zeros(row_numel, dtype=dtype)
            row[: chunk.numel()] = chunk
            rs.append(row)
            ls.append(row[: chunk.numel()])  # FSDP2's local tensor views its padded row
        rows.append(rs)
        locals_.append(ls)
    plans = []
    for r in range(world):
        sources, entries = [], []
        for i, s in enumerate(shapes):
            src = Source(
                i,
                GROUP,
                world,
                r,
                rows[i][r].numel(),
                dtype,
                lambda i=i, r=r: locals_[i][r],
                tuple(range(world)),
                f"p{i}",
                storage=lambda i=i, r=r: rows[i][r],
            )
            sources.append(src)
            e = Entry(f"p{i}", torch.Size(s), contiguous_stride(s), dtype, src, 0)
            e.out_dtype = out_dtype
            entries.append(e)
        bsrc, bentry = _local(fulls["buf"], "buf", len(shapes))
        plans.append(_plan([*entries, bentry], [*sources, bsrc], r, world))
    return Sharded(plans, fulls, world)


def local_tensor(full: torch.Tensor, ranges) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The local tensor whose dims hold the global index ranges ``ranges``."""
    if ranges is None:
        return full.new_empty(0)
    out = full
    for d, rs in enumerate(ranges):
        idx = torch.cat([torch.arange(g, g + n) for g, _, n in rs])
        out = out.index_select(d, idx)
    return out.contiguous()


def nd(
    shapes: list[tuple[int, ...]],
    mesh_shape: tuple[int, ...],
    placements: tuple[object, ...],
    dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype | None = None,
    seed: int = 0,
) -> Sharded:
    """Every parameter a DTensor of ``placements`` on a mesh of ``mesh_shape`` (ranks
    row-major), as tensor parallelism, FSDP2 on an N-D mesh or expert parallelism lay it
    out: rank g holds the local tensor torch's placements give its coordinate, in a row
    padded to the largest; a source's group is one replica (the ranks sharing g's
    coordinate on the replicated mesh dims), rows in rank order."""
    from shardgather._plan import dtensor

    world = math.prod(mesh_shape)
    grid = torch.arange(world).view(mesh_shape)
    fulls = _fulls(shapes, dtype, seed)
    sharded = [d for d, p in enumerate(placements) if dtensor.is_sharding(p)]
    plans = []
    for g in range(world):
        coord = dtensor.coordinate(grid, g)
        ranks = tuple(sorted(dtensor.replica(grid, coord, sharded)))
        coords = [dtensor.coordinate(grid, r) for r in ranks]
        sources, entries = [], []
        for i, s in enumerate(shapes):
            p, blocks, classic, _ = dtensor.rows_layout(f"p{i}", s, mesh_shape, coords, placements)
            ranges = dtensor.dim_ranges(tuple(s), mesh_shape, coord, placements)
            local = local_tensor(fulls[f"p{i}"], ranges).reshape(-1)
            # Rows are views into a larger storage, as real shards are (offset bugs show).
            row = torch.zeros(p + 3, dtype=dtype)[3:]
            row[: local.numel()] = local
            n = local.numel()
            src = Source(
                i,
                GROUP,
                len(ranks),
                ranks.index(g),
                p,
                dtype,
                lambda row=row, n=n: row[:n],
                ranks,
                f"p{i}",
                storage=lambda row=row: row,
            )
            sources.append(src)
            e = Entry(
                f"p{i}",
                torch.Size(s),
                contiguous_stride(s),
                dtype,
                src,
                0,
                blocks=None if classic else blocks,
            )
            e.out_dtype = out_dtype
            entries.append(e)
        bsrc, bentry = _local(fulls["buf"], "buf", len(shapes))
        plans.append(_plan([*entries, bentry], [*sources, bsrc], g, world))
    return Sharded(plans, fulls, world)
