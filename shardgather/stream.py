"""Full tensors as a stream, and gathers that reuse their destinations: weight sync into
an inference engine every step, repeated exports.

Two verbs on one object, :class:`Gatherer`, which holds what repeated calls reuse:

- :meth:`Gatherer.iter_full_tensors` yields ``(key, full tensor)`` bucket by bucket —
  one collective per bucket, the next one in flight while the consumer handles the
  current one — copied out of the gathered bucket into one reused slab.
- :meth:`Gatherer.full_state_dict` returns the same dict every call, written in place:
  on one host into the same shared-memory regions (kept open, so their pages are
  already faulted in and no hand-off collective is needed), else into the same tensors.

``shardgather.iter_full_tensors(model)`` is the one-shot form.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from . import _layout as L
from . import _node_local, _ops
from ._collectives import BucketGathers, agree, bucket_parts, my_buckets, use_gather
from ._options import DEFAULT_TIMEOUT, default_bucket_mb, verify_options, verify_transport
from ._pieces import copy_local
from ._plan import Entry, GatherPlan, build_plan, memory_order_flat
from .api import all_ok, gather_plan
from .errors import CollectiveError

_ALIGN = 64


class Gatherer:
    """Repeated full gathers of one model that allocate nothing after the first call.

    Create it on every rank (no collective); every call is collective, on every rank,
    in the same order. The plan is agreed at each call, so a model that changed (new
    shapes, another dtype) simply gets fresh destinations.

    Args:
        model: as for :func:`shardgather.full_state_dict`.
        dtype: cast floating-point tensors (fused into the copy-out).
        bucket_mb: gathered MiB per collective (default as for full_state_dict).
        rank0_only: only global rank 0 receives (else every rank).
        timeout: per-wait timeout.
        transport: as for :func:`shardgather.full_state_dict` (its dict verb only; the
            stream always uses bucketed collectives).
        pin_memory: the dict verb's output in pinned host memory (CUDA models): pinned
            once, by the first call, and reused — pinning is what costs, not the copy.

    Example:
        >>> gatherer = shardgather.Gatherer(model, dtype=torch.bfloat16)
        >>> for step in range(steps):
        ...     train_step()
        ...     engine.load_weights(gatherer.iter_full_tensors())  # e.g. vLLM
        >>> gatherer.close()
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        dtype: torch.dtype | None = None,
        bucket_mb: float | None = None,
        rank0_only: bool = True,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        transport: str = "auto",
        pin_memory: bool = False,
    ) -> None:
        verify_options(model, bucket_mb, dtype)
        verify_transport(transport, pin_memory)
        self.model, self.dtype, self.bucket_mb = model, dtype, bucket_mb
        self.pin_memory = pin_memory
        self.rank0_only, self.timeout, self.transport = rank0_only, timeout, transport
        self._held = _node_local.HeldRegions()
        self._outputs: dict[str, torch.Tensor] | None = None  # the dict verb's
        self._key: str | None = None  # plan fingerprint of _outputs
        self._device = torch.device("cpu")  # where the stream's buffers live
        self._slab = torch.empty(0, dtype=torch.uint8)  # one bucket's outputs
        self._whole: dict[str, torch.Tensor] = {}  # unsharded entries, per key
        self._spare: list[torch.Tensor] = []  # uint8 buffers for entries spread over buckets
        self._spread_bufs: dict[str, torch.Tensor] = {}  # the ones in use, by entry

    def _plan(self) -> GatherPlan:
        plan = build_plan(self.model, dtype=self.dtype)
        agree(plan, self.timeout)
        return plan

    # ------------------------------------------------------------------------ dict

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """As :func:`shardgather.full_state_dict`, into the previous call's tensors.

        Returns:
            The same dict object every call (on the receiving ranks; ``{}`` elsewhere),
            its tensors overwritten in place: copy what you must keep.
        """
        plan = self._plan()
        if self._key != plan.fingerprint:
            self._outputs, self._key = None, plan.fingerprint
        primaries = None
        if self._outputs is not None:
            primaries = {k: self._outputs[k] for k in plan.entries}
        got = gather_plan(
            plan,
            rank0_only=self.rank0_only,
            bucket_mb=self.bucket_mb,
            timeout=self.timeout,
            transport=self.transport,
            pin_memory=self.pin_memory,
            outputs=primaries,
            held=self._held,
        )
        if got is None:
            return {}
        # Held regions or reused tensors: the same memory every call, so keep the first
        # dict (its views stay valid).
        if self._outputs is None:
            self._outputs = {k: got[plan.aliases.get(k, k)] for k in plan.keys}
        return self._outputs

    # ---------------------------------------------------------------------- stream

    def iter_full_tensors(
        self, *, owned: bool = False, device: torch.device | str = "cpu"
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(key, full tensor)`` for every entry of the model, bucket by bucket.

        Every rank must iterate to the end (or until an error), in lockstep: each
        bucket is one collective. Ranks that do not receive (``rank0_only``) yield
        nothing but take part in every gather. Tied weights are yielded once, under
        the first key. Keys are the plain model's.

        Args:
            owned: yield tensors of their own (a copy each). Default: views into
                buffers the gatherer reuses, **valid until the next ``next()``**.
            device: where the yielded tensors live. ``"cuda"`` keeps a CUDA model's
                gathered rows on the GPU (copied out there: ready for a NCCL broadcast
                into an engine); a CPU model's rows are moved there once per bucket.

        The gather of bucket k+1 is in flight while the consumer handles bucket k.
        Memory per rank: one bucket of gathered rows (plus this rank's own row) and
        one slab of bucket k's outputs — two buckets — plus, for parameters larger than
        a bucket, a buffer of their own while their buckets go by (about the largest
        parameter; kept and reused by the gatherer). Independent of the model's size.
        """
        plan = self._plan()
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self._device != device:
            self._device, self._whole, self._spare = device, {}, []
            self._slab = torch.empty(0, dtype=torch.uint8, device=device)
        receives = not self.rank0_only or plan.rank == 0
        bucket_mb = self.bucket_mb if self.bucket_mb is not None else default_bucket_mb(plan)
        buckets = my_buckets(plan, bucket_mb, self.rank0_only)
        # One buffer pair: bucket k+1 is launched once bucket k is copied out, so the
        # gathered rows never outlive their copy-out.
        gathers = BucketGathers(
            buckets,
            lambda b: receives,
            timeout=self.timeout,
            use_gather=use_gather(buckets, self.rank0_only),
            slots=1,
        )
        waited = 0  # buckets waited for; bucket `waited` is in flight if launched
        launched = 0
        if buckets:
            gathers.launch(0)
            launched = 1
        finished = False
        try:
            if receives:
                for key, e in plan.entries.items():
                    if e.source.group is None:  # buffers, unsharded params: no gather
                        out = self._kept(e, owned)
                        copy_local(e.source.local(), e, out)
                        yield key, out
            by_source = plan.entries_by_source()
            dest: dict[str, torch.Tensor] = {}  # entries begun and not yet complete
            left: dict[str, int] = {}  # their elements still to come
            for i, bucket in enumerate(buckets):
                rows = gathers.wait(i)
                waited = i + 1
                done = []
                if rows is not None:
                    if rows.device != device:
                        rows = rows.to(device)
                    parts = bucket_parts(bucket, by_source)
                    done = self._copy_out(rows, parts, owned, dest, left)
                if i + 1 < len(buckets):
                    gathers.launch(i + 1)
                    launched = i + 2
                for key, out in done:
                    yield key, out
                    # The consumer asked for the next one: this buffer may be reused.
                    if key in self._spread_bufs:
                        self._spare.append(self._spread_bufs.pop(key))
            finished = True
        finally:
            if not finished:
                # The consumer raised or stopped here (or a copy failed): keep taking
                # part in the remaining gathers, so that no peer waits for a collective
                # this rank never joins, then tell everyone.
                with contextlib.suppress(Exception):
                    for j in range(waited, len(buckets)):
                        if j >= launched:
                            gathers.launch(j)
                            launched = j + 1
                        gathers.wait(j)
                with contextlib.suppress(Exception):
                    all_ok(False, "stopped before the end of the stream (see its error)")
                self._spare += self._spread_bufs.values()
                self._spread_bufs = {}
        failures = all_ok(True, "")
        if failures:
            raise CollectiveError("iter_full_tensors failed: " + "; ".join(failures))

    def _kept(self, e: Entry, owned: bool) -> torch.Tensor:
        """A destination of the entry's own: fresh when ``owned``, else kept for reuse."""
        buf = None if owned else self._whole.get(e.key)
        if buf is None or buf.dtype != e.target_dtype or buf.shape != e.shape:
            buf = torch.empty_strided(
                tuple(e.shape), e.stride, dtype=e.target_dtype, device=self._device
            )
            if not owned:
                self._whole[e.key] = buf
        return buf

    def _spread_out(self, e: Entry, owned: bool) -> torch.Tensor:
        """A destination for an entry spread over several buckets: fresh when ``owned``,
        else from the spare buffers (best fit; a spare too small is dropped first, so
        the spares stay as few as the entries in flight at once)."""
        if owned:
            return self._kept(e, owned=True)
        # By index: list.remove would compare tensors elementwise.
        fits = [i for i, b in enumerate(self._spare) if b.numel() >= e.nbytes]
        if fits:
            buf = self._spare.pop(min(fits, key=lambda i: self._spare[i].numel()))
        else:
            if self._spare:
                self._spare.pop(max(range(len(self._spare)), key=lambda i: self._spare[i].numel()))
            buf = torch.empty(e.nbytes, dtype=torch.uint8, device=self._device)
        self._spread_bufs[e.key] = buf
        return buf[: e.nbytes].view(e.target_dtype).as_strided(tuple(e.shape), e.stride)

    def _copy_out(
        self,
        rows: torch.Tensor,
        parts: list[Any],
        owned: bool,
        dest: dict[str, torch.Tensor],
        left: dict[str, int],
    ) -> list[tuple[str, torch.Tensor]]:
        """Copy one bucket's parts into their destinations (one copy_out call); return
        the entries now complete. An entry wholly inside the bucket goes to the
        slab (or a fresh tensor when ``owned``); one spread over several buckets to a
        tensor of its own, yielded once its last part has arrived."""
        whole = {p.entry.key: p.entry for p in parts if p.start == 0 and p.numel == p.entry.numel}
        layout: dict[str, int] = {}
        size = 0
        if not owned:
            for key, e in whole.items():
                size = (size + _ALIGN - 1) // _ALIGN * _ALIGN
                layout[key] = size
                size += e.nbytes
            if self._slab.numel() < size:
                self._slab = torch.empty(0, dtype=torch.uint8)  # free before allocating
                self._slab = torch.empty(size, dtype=torch.uint8, device=self._device)
        fulls: list[torch.Tensor] = []
        index: dict[str, int] = {}
        segs: list[L.Segment] = []
        done: list[tuple[str, torch.Tensor]] = []
        for p in parts:
            e = p.entry
            if e.key not in index:
                if e.key in layout:
                    raw = self._slab[layout[e.key] : layout[e.key] + e.nbytes]
                    out = raw.view(e.target_dtype).as_strided(tuple(e.shape), e.stride)
                elif e.key in whole:
                    out = self._kept(e, owned=True)
                else:
                    if e.key not in dest:
                        dest[e.key], left[e.key] = self._spread_out(e, owned), e.numel
                    out = dest[e.key]
                index[e.key] = len(fulls)
                fulls.append(memory_order_flat(out))
                if e.key in whole:
                    done.append((e.key, out))
            segs.append(p.segment.with_dst(index[e.key], p.start * e.target_dtype.itemsize))
            if e.key in left:
                left[e.key] -= p.numel
                if left[e.key] == 0:
                    done.append((e.key, dest.pop(e.key)))
                    del left[e.key]
        if segs:
            _ops.copy_out(rows, 0, L.segment_table(segs), fulls)
        return done

    def close(self) -> None:
        """Release what the gatherer holds (shared regions, slabs, kept tensors)."""
        self._held.close()
        self._outputs, self._key = None, None
        self._slab = torch.empty(0, dtype=torch.uint8)
        self._whole, self._spare, self._spread_bufs = {}, [], {}

    def __enter__(self) -> Gatherer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_full_tensors(
    model: nn.Module,
    *,
    dtype: torch.dtype | None = None,
    bucket_mb: float | None = None,
    rank0_only: bool = True,
    owned: bool = False,
    device: torch.device | str = "cpu",
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(key, full tensor)`` bucket by bucket; see :meth:`Gatherer.iter_full_tensors`.

    One-shot: its slabs are freed at the end. To sync weights every step without
    allocating, keep a :class:`Gatherer`.

    Example:
        >>> for name, tensor in shardgather.iter_full_tensors(model, rank0_only=False):
        ...     engine_param[name].copy_(tensor)
    """
    g = Gatherer(model, dtype=dtype, bucket_mb=bucket_mb, rank0_only=rank0_only, timeout=timeout)
    try:
        yield from g.iter_full_tensors(owned=owned, device=device)
    finally:
        g.close()
