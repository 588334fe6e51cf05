"""The plan's types: sources, entries, and the plan itself, with the range rules every
part of the engine shares. Pure data: nothing here reads FSDP internals or talks to
other ranks, so plans can be built and checked from metadata alone (tests do).

Glossary (one concept, one name, in Python and C++ alike):

- **source**: a 1-D buffer that every rank of its shard group holds one equal-sized,
  padded *row* of (FSDP1: a flat parameter's shard; FSDP2: one parameter's padded
  dim-0 shard; a tensor every rank holds whole: a source of one row, no group).
- **row** (= a **shard**): one rank's part of a source. Rows are rank-major: a gathered
  bucket is uint8 ``[world, row_bytes]``; the copy ops take such rows as ``shards``
  and call the element kind on that side ``shard_kind`` (``layout.h``).
- **entry**: one key of the output state dict — shape, stride, dtype, and where its
  elements start in its source (``base``). Tied aliases point at their primary entry.
- **block**: elements of an entry that one rank holds together: runs of equal length,
  strided on both sides (``_layout.Block``). FSDP1 and FSDP2's dim-0 shards are one run
  per rank; a DTensor's local tensor (tensor parallel, FSDP2 on N-D meshes, expert
  parallel) is one block or a few per rank — row-wise TP: many runs of a row's slice.
- **piece**: a block one rank holds, seen from that rank (where it sits in its row).
- **chunk**: columns ``[lo, hi)`` of a source gathered in one bucket.
- **bucket**: chunks of sources sharing a group, moved by one collective.
- **part**: a run of an entry's elements inside a carrier (a bucket's gathered rows,
  or a message), with the **segment** (a row of the segment table, ``layout.h``) that
  tells the copy op where the part's elements are.
- **slab**: a reused staging buffer (pinned on CUDA).
- **full**: a destination tensor, addressed by the copy ops in memory order.
- **run**: (C++ only) a piece of a segment contiguous on both sides; the kernels'
  unit of work.
- **round**: one bounded agreement of every rank through the store (``_dist``).
- **transport**: how bytes move (node-local, collective; ``remote`` for pieces of
  ranks on other hosts); **sink**: where they go (host dict, files, stream, shards).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .._layout import Block


@dataclass
class Source:
    """A 1-D row-sharded buffer: ``world`` rows of ``row_numel`` elements each."""

    index: int
    group: dist.ProcessGroup | None  # None: a local tensor, nothing to gather
    world: int
    rank: int  # this process's row
    row_numel: int  # P: padded elements per row, equal on every rank
    dtype: torch.dtype
    local: Callable[[], torch.Tensor]  # this rank's row: 1-D, <= row_numel elements
    group_ranks: tuple[int, ...] = ()
    description: str = ""
    # The live storage of this rank's padded row, for loading in place (None: the
    # row cannot be written in place).
    storage: Callable[[], torch.Tensor] | None = None
    # Optimizer state: the index of the model's source this row mirrors (same group,
    # same layout); None for a model's own source.
    origin: int | None = None
    # Where the row lives (known without building it: an optimizer-state row is made
    # on demand).
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def model_index(self) -> int:
        return self.index if self.origin is None else self.origin

    @property
    def row_bytes(self) -> int:
        return self.row_numel * self.dtype.itemsize


@dataclass
class Entry:
    """One key of the output state dict."""

    key: str
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype  # the stored (full-precision) dtype
    source: Source
    base: int  # element offset of element 0 (in memory order) in the source's flat layout
    is_buffer: bool = False
    out_dtype: torch.dtype | None = None  # dtype to produce (None: same as dtype)
    # Where every row's elements are (flat positions in the rank-major rows), when they
    # are not one run from ``base`` (N-D layouts); see :func:`blocks_of`.
    blocks: tuple[Block, ...] | None = None
    trainable: bool = False  # a parameter with requires_grad (keys="trainable")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def target_dtype(self) -> torch.dtype:
        return self.out_dtype or self.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.target_dtype.itemsize

    @property
    def is_contiguous(self) -> bool:
        return self.numel <= 1 or tuple(self.stride) == contiguous_stride(self.shape)


@dataclass
class Phase:
    """Sources a plan moves after one collective step of its own: every rank runs
    ``prepare(call)`` (None: nothing to do) at the same point, then moves these sources
    (a merged export fetches the LoRA factors of a group of layers just before their
    weights, so a rank holds one group's factors at a time, never the whole adapter)."""

    sources: frozenset[int]
    prepare: Callable[[Any], None] | None = None


@dataclass
class GatherPlan:
    """Every output key in ``state_dict()`` order, with aliases for tied tensors."""

    keys: list[str]  # all keys, plain-model order
    entries: dict[str, Entry]  # primary keys only
    aliases: dict[str, str]  # alias key -> primary key
    sources: list[Source]
    rank: int
    world: int
    fingerprint: str = field(default="")
    # Storage identity -> primary key: ("fsdp1", id(flat_param), index),
    # ("fsdp2", id(FSDPParam)) or ("local", id(tensor)). Optimizer state uses it.
    identities: dict[object, str] = field(default_factory=dict)
    # Source index -> the column ranges of its rows this plan needs, when it is a subset
    # (``keys=``) that leaves some of a source's elements out (None: every column).
    columns: dict[int, list[tuple[int, int]]] | None = None
    # The order sources are moved in, phase by phase, when some need a step first
    # (None: one phase of every source, nothing to prepare).
    phases: list[Phase] | None = None

    def phases_or_one(self) -> list[Phase]:
        if self.phases is not None:
            return self.phases
        return [Phase(frozenset(s.index for s in self.sources))]

    def entries_by_source(self) -> dict[int, list[Entry]]:
        out: dict[int, list[Entry]] = {}
        for e in self.entries.values():
            out.setdefault(e.source.index, []).append(e)
        for lst in out.values():
            lst.sort(key=lambda e: e.base)
        return out


def contiguous_stride(shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    stride: list[int] = []
    acc = 1
    for d in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))


def is_dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last) or (t.dim() == 0)


def memory_order_flat(t: torch.Tensor) -> torch.Tensor:
    """The elements of a dense tensor in memory order, 1-D (no copy)."""
    if t.numel() == 0:
        return t.reshape(0)
    return t.as_strided((t.numel(),), (1,))


def fingerprint(plan: GatherPlan) -> str:
    """A digest every rank must agree on before any collective runs."""
    import hashlib

    h = hashlib.sha256()
    for k in plan.keys:
        e = plan.entries.get(k)
        if e is None:
            h.update(f"{k}->{plan.aliases[k]};".encode())
        else:
            s = e.source
            h.update(
                f"{k}:{tuple(e.shape)}:{e.dtype}:{e.target_dtype}:{e.base}:{s.index}:"
                f"{s.world}:{s.row_numel}:{s.dtype}:{s.group is None}:{e.blocks};".encode()
            )
    return h.hexdigest()[:16]


def blocks_of(e: Entry) -> tuple[Block, ...]:
    """Every element of ``e``, as blocks in its source's rank-major rows."""
    if e.blocks is not None:
        return e.blocks
    return (Block(e.base, 0, e.numel),) if e.numel else ()


def row_blocks(e: Entry, row: int | None) -> list[Block]:
    """The elements of ``e`` that row ``row`` of its source holds (all of a local
    tensor; none for ``None``, a rank outside the source's group)."""
    if e.source.group is None:
        return [Block(e.base, 0, e.numel)] if e.numel else []
    if row is None:
        return []
    p = e.source.row_numel
    return [c for b in blocks_of(e) for c in b.clip(row * p, (row + 1) * p)]


def own_blocks(e: Entry, src: Source | None = None) -> list[Block]:
    """This rank's elements of ``e`` in its row of ``src`` (default: the entry's own
    source), or all of a local tensor."""
    src = src or e.source
    return row_blocks(e, src.rank if src.group is not None else 0)


def flat_of(e: Entry, full: torch.Tensor) -> torch.Tensor:
    """``full`` in ``e``'s memory order, flattened."""
    t = full.detach()
    if not e.is_contiguous:
        t = torch.empty_strided(tuple(e.shape), e.stride, dtype=t.dtype, device=t.device).copy_(t)
    return memory_order_flat(t.contiguous() if e.is_contiguous else t)


def group_info(group: dist.ProcessGroup | None) -> tuple[int, int, tuple[int, ...]]:
    if group is None or not dist.is_initialized():
        return 1, 0, (0,)
    ranks = tuple(dist.get_process_group_ranks(group))
    return dist.get_world_size(group), dist.get_rank(group), ranks


def row_of_rank(src: Source, global_rank: int) -> int | None:
    """The row of ``src`` that global ``global_rank`` holds (None: not in its group).
    Group ranks follow ``group_ranks`` order, so any rank's row is known from metadata."""
    if src.group is None:
        return 0  # every rank holds a local source whole
    try:
        return src.group_ranks.index(global_rank)
    except ValueError:
        return None
