"""Merged weights in the plan: ``W + delta`` computed by each rank for its own elements
of ``W``, so a merged export moves and writes exactly what a plain one does and no rank
ever holds a full weight. The plan's other parts — keys dropped (the adapter's) and
renamed (the base model's names) — are plain bookkeeping. What a delta is (LoRA:
``scale * B @ A``) is the caller's; this module only places it."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any

import torch

from .._layout import Block
from .types import Entry, GatherPlan, Phase, Source, fingerprint, own_blocks

# Rows [r0, r1) of the delta of a 2-D weight, float32, contiguous [r1 - r0, columns].
Delta = Callable[[int, int], torch.Tensor]


# Delta elements computed at a time: a merged row adds its deltas in slices of rows, so
# a delta never costs a second copy of the row.
DELTA_ELEMENTS = 1 << 20


@dataclass
class Fetch:
    """How a merged plan gets what its deltas read (a LoRA adapter's factors), group by
    group: ``prepare(keys)`` makes the collective step that fetches what the deltas of
    ``keys`` need (dropping the previous group's), ``cost[key]`` is what it holds for
    one key, and a group holds at most ``budget`` bytes (or one source's, when more)."""

    prepare: Callable[[list[str]], Callable[[Any], None]]
    cost: dict[str, int]
    budget: int


def merged(
    plan: GatherPlan,
    deltas: dict[str, Delta],
    drop: Collection[str],
    rename: Callable[[str], str],
    fetch: Fetch | None = None,
) -> GatherPlan:
    """``plan`` with ``deltas[key]`` added to those (2-D, contiguous) entries, the keys
    in ``drop`` left out and every key renamed.

    A source holding a merged entry gets a row built on demand: this rank's row, in
    float32 when it is a lower precision, with each merged entry's own elements plus
    their delta (the delta rows those elements cover, nothing more, a slice of rows at
    a time). One such row is kept at a time. Entries that share the source (FSDP1) keep
    their values and are cast back to their dtype on the way out. With ``fetch``, the
    plan moves in phases (``GatherPlan.phases``): consecutive sources whose merged
    entries' costs fit the budget, each phase after the step that fetches their
    deltas' inputs."""
    items: dict[int, list[tuple[Entry, Delta]]] = {}
    for key, delta in deltas.items():
        e = plan.entries[key]
        if len(e.shape) != 2 or not e.is_contiguous:
            raise ValueError(f"{key}: a merged weight must be 2-D and contiguous")
        items.setdefault(e.source.index, []).append((e, delta))
    last: dict[str, object] = {}  # the one merged row kept: {"index": i, "row": tensor}
    sources = list(plan.sources)
    for index, merges in items.items():
        src = plan.sources[index]
        work = torch.float32 if src.dtype in (torch.float16, torch.bfloat16) else src.dtype
        sources[index] = replace(
            src,
            dtype=work,
            local=_merged_row(src, merges, work, last),
            storage=None,  # not a live buffer: nothing loads into it
            description=src.description + " (adapter merged)",
        )
    entries: dict[str, Entry] = {}
    for key, e in plan.entries.items():
        if key in drop:
            continue
        new = sources[e.source.index]
        if new is not e.source:
            e = replace(e, source=new, dtype=new.dtype, out_dtype=e.out_dtype or e.dtype)
        entries[rename(key)] = replace(e, key=rename(key))
    keys = [rename(k) for k in plan.keys if k not in drop]
    aliases = {
        rename(a): rename(p) for a, p in plan.aliases.items() if a not in drop and p not in drop
    }
    identities = {i: rename(k) for i, k in plan.identities.items() if k not in drop}
    out = replace(
        plan,
        keys=keys,
        entries=entries,
        aliases=aliases,
        sources=sources,
        identities=identities,
        columns=None,
    )
    if fetch is not None:
        out.phases = _phases(plan, items, fetch)
    out.fingerprint = fingerprint(out)
    return out


def _phases(
    plan: GatherPlan, items: dict[int, list[tuple[Entry, Delta]]], fetch: Fetch
) -> list[Phase]:
    """Consecutive sources, in plan order, grouped so that each group's merged entries
    cost at most the budget (a source over it alone); every rank groups alike (costs
    are full tensors' sizes, the same everywhere)."""
    phases: list[Phase] = []
    indices: list[int] = []
    held: list[str] = []
    total = 0
    for src in plan.sources:
        keys = [e.key for e, _ in items.get(src.index, [])]
        cost = sum(fetch.cost[k] for k in keys)
        if held and total + cost > fetch.budget:
            phases.append(Phase(frozenset(indices), fetch.prepare(held)))
            indices, held, total = [], [], 0
        indices.append(src.index)
        held.extend(keys)
        total += cost
    phases.append(Phase(frozenset(indices), fetch.prepare(held) if held else None))
    return phases


def _merged_row(
    src: Source, merges: list[tuple[Entry, Delta]], work: torch.dtype, last: dict[str, object]
) -> Callable[[], torch.Tensor]:
    def row() -> torch.Tensor:
        if last.get("index") == src.index:
            return last["row"]  # type: ignore[return-value]
        last.clear()  # the previous merged row goes before this one is built
        out = src.local().to(work, copy=True)
        first = src.rank * src.row_numel if src.group is not None else 0
        for e, delta in merges:
            cols = e.shape[1]
            for whole in own_blocks(e, src):
                step = _slice_elements(whole, cols)
                for s0 in range(0, whole.numel, step):
                    for b in whole.sub(s0, min(s0 + step, whole.numel)):
                        _add_delta(out, b, first, cols, delta)
        last.update(index=src.index, row=out)
        return out

    return row


def _slice_elements(b: Block, cols: int) -> int:
    """Elements of ``b`` per slice: those of about DELTA_ELEMENTS // cols rows of the
    weight (whole runs when ``b`` is strided: a run of row-wise TP is part of a row)."""
    rows = max(1, DELTA_ELEMENTS // cols)
    if b.contiguous:
        return rows * cols
    return max(1, rows * cols // max(b.strides[1], 1)) * b.run_numel


def _add_delta(out: torch.Tensor, b: Block, first: int, cols: int, delta: Delta) -> None:
    """Block ``b``'s elements of ``out`` (a rank's row, whose element 0 is flat position
    ``first``) plus their delta: the delta rows they cover, nothing more."""
    r0 = b.full // cols
    r1 = b.full_elem(b.numel - 1) // cols + 1
    d = delta(r0, r1).reshape(-1)
    at, off = b.shard - first, b.full - r0 * cols
    if b.contiguous:
        out[at : at + b.numel] += d[off : off + b.numel]
    else:
        shape = (b.count, b.run_numel)
        view = out.as_strided(shape, (b.strides[0], 1), out.storage_offset() + at)
        view += d.as_strided(shape, (b.strides[1], 1), d.storage_offset() + off)
