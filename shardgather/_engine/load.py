"""The engine backwards: full tensors from a source into each rank's own shards.

Sources (this rank's view of what is being loaded, validated locally first):

- :class:`StoredSource`: tensors in files — a safetensors file, a Hugging Face
  directory, a DCP directory (:class:`shardgather.io.stored.StoredTensor`: where every
  element's bytes are);
- :class:`DictSource`: a dict of full tensors (a torch file is one, memory-mapped).

Transports: **node-local** — every rank holds the source (the file is visible to it,
or it has the dict) and takes exactly its own elements (preads only its own byte
ranges); **collective** — only rank 0 holds it, and sends each rank its own elements
of each tensor, point to point, one tensor at a time, in an order every rank computes
up front. The sink is :class:`Shards`: the copy-in op writes (and casts) into each
rank's shard storage — a model's, or fresh optimizer-state rows.

Rounds: the **plan round** agrees on the plan, on every rank's validation of its
source (so a bad source fails everywhere before any shard changes) and on who holds
the source; the **done round** after the data moved.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch

from .. import _dist, _ops
from .. import _layout as L
from .._dist import Call, data_group
from .._fqn import clean_fqn, has_wrapper_components
from .._options import Options, Transport
from .._plan import Block, Entry, GatherPlan, flat_of, own_blocks, row_blocks
from .._progress import Progress
from ..errors import ShardGatherError, StateDictMismatchError
from ..io.safetensors_format import pread_into
from ..io.stored import StoredTensor

Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


class LoadResult(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


# ------------------------------------------------------------------------ sources


class DictSource:
    """Full tensors by model key (a dict, or a memory-mapped torch file)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    @property
    def has(self) -> bool:
        return bool(self.tensors)

    def shapes(self) -> Shapes:
        return {k: (tuple(v.shape), v.dtype) for k, v in self.tensors.items()}

    def flat(self, e: Entry, key: str) -> torch.Tensor:
        """The whole entry, memory order, 1-D (rank 0 of a collective load)."""
        return flat_of(e, self.tensors[key])

    def locate_own(self, plan: GatherPlan, keys: Mapping[str, str]) -> None:
        pass

    def load_own(self, sink: Shards, e: Entry, key: str) -> None:
        sink.write_own(e, self.tensors[key])

    def close(self) -> None:
        pass


class StoredSource:
    """Tensors in files, by model key."""

    def __init__(self, tensors: Mapping[str, StoredTensor], what: str) -> None:
        self.tensors, self.what = tensors, what
        self._fds: dict[str, int] = {}

    @property
    def has(self) -> bool:
        return True

    def shapes(self) -> Shapes:
        return {k: (tuple(t.shape), t.dtype) for k, t in self.tensors.items()}

    def fd(self, path: str) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def read(self, key: str, lo: int, hi: int, buf: torch.Tensor) -> None:
        """Elements ``lo:hi`` (row-major) of ``key`` into ``buf`` (uint8)."""
        stored = self.tensors[key]
        size = stored.dtype.itemsize
        for path, offset, first, count in stored.runs(lo, hi):
            at = (first - lo) * size
            pread_into(self.fd(path), buf[at : at + count * size], offset)
            _dist.STATS["bytes_read"] += count * size

    def load_own(self, sink: Shards, e: Entry, key: str) -> None:
        sink.read_own(e, self, key)

    def flat(self, e: Entry, key: str) -> torch.Tensor:
        stored = self.tensors[key]
        raw = torch.empty(stored.nbytes, dtype=torch.uint8)
        self.read(key, 0, stored.numel, raw)
        full = raw.view(stored.dtype).view(stored.shape)
        return flat_of(e, full)

    def locate_own(self, plan: GatherPlan, keys: Mapping[str, str]) -> None:
        """Find where this rank's elements are (a DCP chunk is located from its own small
        zip directory): done before the plan round, so that a damaged chunk is refused
        on every rank before any shard changes."""
        for key, e in plan.entries.items():
            src_key = keys.get(key)
            if src_key is None:
                continue
            stored = self.tensors[src_key]
            spans = (
                [(0, stored.numel)]
                if not e.is_contiguous
                else [(b.full, b.full_elem(b.numel - 1) + 1) for b in own_blocks(e)]
            )
            for lo, hi in spans:
                for _ in stored.runs(lo, hi):
                    pass


Source = DictSource | StoredSource


# ------------------------------------------------------------------------ validation


def source_key(plan: GatherPlan, key: str, available: Mapping[str, Any]) -> str | None:
    """The key a source holds an entry under: its own, or a tied alias's."""
    if key in available:
        return key
    return next((a for a, p in plan.aliases.items() if p == key and a in available), None)


def castable(dtype: torch.dtype) -> bool:
    """The copy kernels cast between fp16, bf16, fp32 and fp64; any other dtype (e.g.
    float8) is copied as raw bytes, so it must match exactly."""
    return dtype in L.KIND_DTYPE.values()


def validate(
    plan: GatherPlan,
    available: Shapes,
    strict: bool,
    what: str,
    renamed: Mapping[str, str] | None = None,
    others: Collection[str] = (),
    partial: bool = False,
) -> LoadResult:
    """Compare the source's keys/shapes/dtypes with the model before touching anything.
    A tied alias counts as present when its primary is (and vice versa). ``renamed``:
    model key -> the source's own name, where a key map changed it (errors say both).
    ``others``: the model's keys outside a subset plan (``keys=``): the source's copies
    of them are left alone, not unexpected. ``partial``: the source holds a subset
    by design (a ``keys=`` checkpoint): the model's other keys are left alone, not
    missing."""
    renamed = renamed or {}

    def named(k: str) -> str:
        return f"{k} (source key {renamed[k]!r})" if k in renamed else k

    have = set(available)
    for alias, primary in plan.aliases.items():
        if alias in have:
            have.add(primary)
        if primary in have:
            have.add(alias)
    missing = [] if partial else [k for k in plan.keys if k not in have]
    unexpected = sorted(set(available) - set(plan.keys) - set(others))
    mismatched: dict[str, str] = {}
    for key, e in plan.entries.items():
        src_key = source_key(plan, key, available)
        if src_key is None:
            continue
        shape, dtype = available[src_key]
        if tuple(shape) != tuple(e.shape):
            mismatched[key] = f"shape {tuple(shape)} in source, {tuple(e.shape)} in model"
        elif dtype != e.dtype and not (castable(dtype) and castable(e.dtype)):
            mismatched[key] = f"dtype {dtype} in source, {e.dtype} in model (cannot cast)"
    if plan.keys and not any(k in have for k in plan.keys):
        # strict=False loads "only the matching keys": with none, it would load nothing
        # and return as if it had.
        hint = _fix_for(list(plan.keys), unexpected) if unexpected else ""
        raise StateDictMismatchError(
            f"{what} holds none of the model's {len(plan.keys)} keys (e.g. "
            f"{next(iter(plan.keys))!r}; the source has {[named(k) for k in unexpected[:3]]}"
            f"{'...' if len(unexpected) > 3 else ''}): nothing was loaded. {hint}"
            "Is it the checkpoint of this model, with its names (key_map= renames them)?",
            list(plan.keys) if not partial else [],
            unexpected,
            mismatched,
        )
    if mismatched or (strict and (missing or unexpected)):
        parts = []
        if missing:
            parts.append(f"missing keys {missing}")
        if unexpected:
            parts.append(f"unexpected keys {[named(k) for k in unexpected]}")
        if mismatched:
            parts.append(
                "mismatched " + "; ".join(f"{named(k)}: {v}" for k, v in mismatched.items())
            )
        raise StateDictMismatchError(
            f"{what} does not match the model: "
            + ", ".join(parts)
            + ". Nothing was loaded. "
            + (_fix_for(missing, unexpected) if not mismatched else "")
            + "Pass strict=False to load only the matching keys.",
            missing,
            unexpected,
            mismatched,
        )
    return LoadResult(missing, unexpected)


def _fix_for(missing: list[str], unexpected: list[str]) -> str:
    """The working fix when the names differ only in a way a key_map repairs: wrapper
    components (FSDP1's ``_fsdp_wrapped_module.``, DDP's ``module.``, ``_orig_mod.``) or
    one prefix on either side. "" when no such rule explains every missing key."""
    if not missing or not unexpected:
        return ""
    want = set(missing)
    if want <= {clean_fqn(u) for u in unexpected} and any(
        has_wrapper_components(u) for u in unexpected
    ):
        return (
            "The source's names carry wrapper components (e.g. "
            f"{next(u for u in unexpected if has_wrapper_components(u))!r}): load with "
            "key_map=sg.clean_fqn, or repair the file once with `python -m shardgather "
            "clean-keys SRC OUT`. "
        )
    m = missing[0]
    have = set(unexpected)
    for u in unexpected:  # the source has an extra prefix: {"prefix.": ""}
        if u.endswith(m) and len(u) > len(m):
            prefix = u[: len(u) - len(m)]
            if all(prefix + k in have for k in missing):
                return f"The source's names carry the prefix {prefix!r}: load with key_map={{{prefix!r}: ''}}. "
    for u in unexpected:  # the model has an extra prefix: {"": "prefix."}
        if m.endswith(u) and len(m) > len(u):
            prefix = m[: len(m) - len(u)]
            if all(k.startswith(prefix) and k[len(prefix) :] in have for k in missing):
                return f"The model's names carry the prefix {prefix!r}: load with key_map={{'': {prefix!r}}}. "
    return ""


# ------------------------------------------------------------------------ the sink


class Shards:
    """Each rank's own shard storage of every entry, written in place by the copy-in
    op (cast to the shard's dtype), through one staging buffer where needed."""

    def __init__(self, staging_bytes: int) -> None:
        self.staging_bytes = staging_bytes
        self._staging = torch.empty(0, dtype=torch.uint8)

    @staticmethod
    def row(e: Entry) -> tuple[torch.Tensor, int]:
        """The storage this rank's elements of ``e`` are written to (uint8 ``[1, bytes]``:
        its row, which may be shorter than the source's rows — FSDP2 pads each rank's
        shard to its own size), and the flat position of its first element."""
        src = e.source
        if src.storage is None:
            raise ShardGatherError(
                f"{e.key!r}: its tensor is not dense; it cannot be loaded in place"
            )
        t = src.storage()
        row = t.view(torch.uint8).view(1, -1) if t.element_size() > 1 else t.view(1, -1)
        return row, src.rank * src.row_numel

    def write(self, e: Entry, block: Block, data: torch.Tensor, packed: bool = True) -> None:
        """The elements of ``block`` (flat positions in the source's rows; this rank's)
        into this rank's shard storage, cast to its dtype: from ``data``, packed run
        after run (``packed``), or the entry's whole memory-order flat (block.full on)."""
        row, origin = self.row(e)
        src = e.source
        if row.is_cuda:
            data = data.to(row.device)
        elif data.device.type != "cpu":
            data = data.cpu()
        kinds = (L.kind_of(src.dtype), L.kind_of(data.dtype))
        width = row.shape[1] // src.dtype.itemsize  # the storage seen as one row
        at = replace(block, shard=block.shard - origin)
        if packed:
            r = block.run_numel
            packed_at = Block(at.shard, 0, at.numel, r, at.strides[0], r)
            seg = L.Segment.of(packed_at, width, 0, *kinds)
        else:
            seg = L.Segment.of(at, width, 0, *kinds, 0, block.full * data.element_size())
        _ops.copy_in([data.contiguous()], L.segment_table([seg]), row, 0)
        if row.is_cuda:
            torch.cuda.current_stream(row.device).synchronize()  # the kernel's stream

    def write_own(self, e: Entry, full: torch.Tensor) -> None:
        """This rank's elements of one entry, from a full tensor."""
        flat = flat_of(e, full)
        for b in own_blocks(e):
            self.write(e, b, flat, packed=False)

    def read_own(self, e: Entry, source: StoredSource, key: str) -> None:
        """pread exactly this rank's elements of ``e`` (from whichever files hold them)."""
        if not e.is_contiguous:
            # The file is row-major, the shard holds memory order: read it whole and
            # re-lay it out first (non-contiguous params are small: conv weights).
            flat = source.flat(e, key)
            for b in own_blocks(e):
                self.write(e, b, flat, packed=False)
            return
        for b in own_blocks(e):
            self._read_block(e, b, source, key)

    def _read_block(self, e: Entry, b: Block, source: StoredSource, key: str) -> None:
        stored = source.tensors[key]
        row, origin = self.row(e)
        src = e.source
        fsize = stored.dtype.itemsize
        r = b.run_numel
        ss, fs = b.strides
        if stored.dtype == src.dtype and not row.is_cuda:
            # Same dtype, host shard: the file's bytes are the shard's bytes, so pread
            # them straight into place (no staging, no second copy), run by run.
            for i in range(b.count):
                start = (b.shard + i * ss - origin) * fsize
                lo = b.full + i * fs
                source.read(key, lo, lo + r, row[0, start : start + r * fsize])
            return
        # Whole runs through the staging buffer (a run longer than it: one at a time).
        per = max(1, self.staging_bytes // (r * fsize)) * r
        for a in range(0, b.numel, per):
            for part in b.sub(a, min(b.numel, a + per)):
                n = part.numel * fsize
                if self._staging.numel() < n:
                    # CUDA shards read pinned staging through its mapped address.
                    self._staging = torch.empty(n, dtype=torch.uint8, pin_memory=row.is_cuda)
                buf = self._staging[:n]
                pr = part.run_numel
                for i in range(part.count):
                    lo = part.full + i * part.strides[1]
                    source.read(key, lo, lo + pr, buf[i * pr * fsize : (i + 1) * pr * fsize])
                self.write(e, part, buf.view(stored.dtype))


# ------------------------------------------------------------------------ the driver


@dataclass
class Loading:
    """One plan to load: this rank's source (None: it has none), and — once validated,
    on every rank — which source key feeds each primary key, and each source key's dtype
    (what a rank receiving from rank 0 allocates)."""

    plan: GatherPlan
    source: Source | None
    keys: dict[str, str] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)

    @property
    def has(self) -> bool:
        return self.source is not None and self.source.has

    def take(self, shapes: Shapes) -> None:
        """Record what feeds each entry (after validation against ``shapes``)."""
        for key in self.plan.entries:
            src_key = source_key(self.plan, key, shapes)
            if src_key is not None:
                self.keys[key] = src_key
        self.dtypes = {k: dtype for k, (_, dtype) in shapes.items()}


@dataclass
class Agreement:
    node_local: bool
    rank0_extra: Any  # what rank 0 posted (e.g. the shapes it validated)
    rows_of: list[dict[int, int]] | None  # rank 0: every rank's row of every model source


def plan_round(
    call: Call, plan: GatherPlan, has: bool, opts: Options, extra: Any = None, also_same: str = ""
) -> Agreement:
    """The plan round of a load: every rank's plan and validation agreed (a failure
    anywhere raises everywhere, before any shard changes), who holds the source, and —
    for rank 0, which may have to send every rank its elements — every rank's row of
    every source (with HSDP, other replicas' shard groups are not in rank 0's plan).
    ``also_same``: more that must be equal on every rank (the optimizer's groups), for
    ranks that validate against what rank 0 sends, after this round."""
    rows = {s.index: s.rank for s in plan.sources if s.group is not None}
    payload = (has, rows, extra if call.rank == 0 else None)
    same = plan.fingerprint + (f"+{also_same}" if also_same else "")
    got = call.round("plan", same=same, payload=payload, gather="to0", count=int(has))
    everyone = call.count == call.world
    rank0 = got[0] if call.rank == 0 else got
    if not rank0[0]:
        raise ShardGatherError(
            f"{call.what}: rank 0 has nothing to load (an empty dict or no file there). "
            "Rank 0 must hold the source; other ranks may pass {} or a path they cannot see."
        )
    if opts.transport == Transport.NODE_LOCAL and not everyone:
        raise ShardGatherError(
            f"{call.what}: transport='node-local' needs the source on every rank, "
            f"{call.world - call.count} rank(s) lack it; use 'auto' to let rank 0 send it"
        )
    return Agreement(
        node_local=everyone and opts.transport != Transport.COLLECTIVE,
        rank0_extra=rank0[2],
        rows_of=[g[1] for g in got] if call.rank == 0 else None,
    )


def run(
    call: Call,
    plan: GatherPlan,
    opts: Options,
    *,
    seen: Any,
    build: Callable[[Any], list[Loading]],
    sources: Sequence[Source | None] = (),
    also_same: str = "",
) -> Any:
    """The way back, for every load verb: the plan round, then the loadings, the data
    phase and the done round. A rank that read and validated its source (``seen``: what
    it found — shapes, optimizer metadata... — never None then) takes part as a holder;
    rank 0's ``seen`` goes to the ranks that hold nothing, which validate against it.
    ``build(seen)`` makes the loadings once every rank agreed (a failure anywhere before
    that raises on every rank and changes nothing). ``sources``: closed at the end.

    Returns:
        Rank 0's ``seen`` (what only rank 0 reads, such as a checkpoint's ``extra``, is
        every rank's then).
    """
    bar: Progress | None = None
    try:
        agreed = plan_round(call, plan, seen is not None, opts, extra=seen, also_same=also_same)
        view = seen if seen is not None else agreed.rank0_extra
        loadings = build(view)
        total = sum(e.nbytes for ld in loadings for e in ld.plan.entries.values())
        bar = Progress(call, opts.progress, total, f"shardgather: {call.what}")
        move(call, loadings, agreed, opts, bar)
        call.round("done")
        bar.done()
        return agreed.rank0_extra
    finally:
        if bar is not None:
            bar.close()
        for src in sources:
            if src is not None:
                src.close()


def move(
    call: Call, loadings: list[Loading], agreed: Agreement, opts: Options, bar: Progress
) -> None:
    """The data phase: every loading's present entries into this rank's shards."""
    sink = Shards(opts.bucket_bytes(False))
    if agreed.node_local:
        for ld in loadings:
            assert ld.source is not None
            for key, e in ld.plan.entries.items():
                src_key = ld.keys.get(key)
                if src_key is not None:
                    ld.source.load_own(sink, e, src_key)
                    if e.source.group is not None or call.rank == 0:  # whole: counted once
                        bar.update(sum(b.numel for b in own_blocks(e)) * e.dtype.itemsize)
        bar.report(last=True)
        if call.rank == 0:
            bar.watch_others()
    else:
        group = data_group(call)
        for ld in loadings:
            _scatter(call, ld, sink, group, agreed.rows_of, bar)


def blocks_for(e: Entry, rows: Mapping[int, int]) -> list[Block]:
    """The elements of ``e`` that the rank whose rows are ``rows`` holds."""
    if e.source.group is None:
        return row_blocks(e, 0)
    return row_blocks(e, rows.get(e.source.model_index))


def _elements(flat: torch.Tensor, blocks: list[Block]) -> torch.Tensor:
    """The elements of ``blocks`` of a memory-order flat tensor, packed (one tensor)."""
    views = [
        flat[b.full : b.full + b.numel]
        if b.contiguous
        else flat[b.full :].as_strided((b.count, b.run_numel), (b.strides[1], 1)).reshape(-1)
        for b in blocks
    ]
    return views[0].contiguous() if len(views) == 1 else torch.cat(views)


def _scatter(
    call: Call,
    ld: Loading,
    sink: Shards,
    group: Any,
    rows_of: list[dict[int, int]] | None,
    bar: Progress,
) -> None:
    """Rank 0 sends every rank its own elements of each present entry, in plan order,
    one entry at a time (the schedule: the plan and the keys, known to every rank);
    each rank copies its own in. Rank 0 knows every rank's row of every source from
    the plan round."""
    tag = 0
    for key, e in ld.plan.entries.items():
        src_key = ld.keys.get(key)
        if src_key is None:
            continue
        tag += 1
        mine = own_blocks(e)
        if call.rank == 0:
            assert ld.source is not None and rows_of is not None
            flat = ld.source.flat(e, src_key)
            works = []
            for r in range(1, call.world):
                theirs = blocks_for(e, rows_of[r])
                if theirs:
                    works.append((_dist.send(group, _elements(flat, theirs), r, tag), r))
            for b in mine:
                sink.write(e, b, flat, packed=False)
            for work, r in works:
                call.wait(work, f"sending {key} to rank {r}", r)
            bar.update(e.nbytes)  # rank 0 reads and sends every byte: its count is the job's
        elif mine:
            buf = torch.empty(sum(b.numel for b in mine), dtype=ld.dtypes[src_key])
            work = _dist.recv(group, buf, 0, tag)
            call.wait(work, f"receiving {key} from rank 0", 0)
            at = 0
            for b in mine:
                sink.write(e, b, buf[at : at + b.numel])
                at += b.numel
