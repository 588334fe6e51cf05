"""Full tensors as a stream, and gathers that reuse their destinations: weight sync into
an inference engine every step, repeated exports.

Two verbs on one object, :class:`Gatherer`, which holds what repeated calls reuse:

- :meth:`Gatherer.iter_full_tensors` yields ``(key, full tensor)`` bucket by bucket —
  one collective per bucket, the next one in flight while the consumer handles the
  current one — copied out of the gathered bucket into one reused slab.
- :meth:`Gatherer.iter_packed` yields the same buckets packed: one flat byte buffer per
  bucket, its full tensors back to back (64-byte aligned) with their names, shapes,
  dtypes, offsets and sizes — what a packed weight transfer (vLLM's) sends as one
  message; :mod:`shardgather.weight_sync` sends them to an inference engine.
- :meth:`Gatherer.full_state_dict` returns the same dict every call, written in place:
  on one host into the same shared-memory regions (kept open, so their pages are
  already faulted in and no hand-off is needed), else into the same tensors.

``shardgather.iter_full_tensors(model)`` is the one-shot form.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ._dist import Call
from ._engine import run
from ._engine.node_local import Regions
from ._engine.sinks import HostDict, StreamSink
from ._options import DEFAULT_TIMEOUT, Options, Transport, check_model
from ._plan import GatherPlan, build_plan
from ._plan.subset import KeySelection
from .api import merge_transform, with_aliases
from .errors import CollectiveError, ShardGatherError


@dataclass
class PackedBucket:
    """Full tensors back to back in one flat byte buffer, each at a 64-byte aligned
    offset: one message of a packed weight transfer. ``buffer`` is reused by the
    gatherer: valid until the next bucket is asked for."""

    buffer: torch.Tensor  # uint8, 1-D
    names: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[torch.dtype]
    offsets: list[int]  # bytes, into buffer
    sizes: list[int]  # bytes

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, view into buffer)`` for each tensor."""
        return [
            (n, self.buffer[o : o + z].view(d).view(s))
            for n, s, d, o, z in zip(self.names, self.shapes, self.dtypes, self.offsets, self.sizes)
        ]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


def _packed(
    buffer: torch.Tensor, layout: dict[str, int], used: int, plan: GatherPlan
) -> PackedBucket:
    keys = sorted(layout, key=layout.__getitem__)
    es = [plan.entries[k] for k in keys]
    return PackedBucket(
        buffer[:used],
        keys,
        [tuple(e.shape) for e in es],
        [e.target_dtype for e in es],
        [layout[k] for k in keys],
        [e.nbytes for e in es],
    )


# What the other ranks learn when one leaves a stream early (GeneratorExit: a ``break``,
# or an exception raised in the loop's body, which stays on that rank).
_STOPPED = (
    "its loop stopped before the end of the stream (a `break`, or an error raised in the "
    "loop's body on that rank): every rank must iterate to the end, in lockstep"
)


class Gatherer:
    """Repeated full gathers of one model that allocate nothing after the first call.

    Create it on every rank (no collective); every call is collective, on every rank,
    in the same order. The plan is agreed at each call, so a model that changed (new
    shapes, another dtype) simply gets fresh destinations.

    Args:
        model: as for :func:`shardgather.full_state_dict`.
        dtype: cast floating-point tensors (fused into the copy-out).
        keys: only these keys (as for :func:`shardgather.full_state_dict`; e.g.
            ``"trainable"`` to sync a LoRA policy's adapters): nothing else moves.
        merge_adapter: the base weights with this PEFT LoRA adapter merged in (as for
            :func:`shardgather.full_state_dict`): a LoRA policy synced into an engine
            that serves the base architecture.
        bucket_mb: gathered MiB per collective (default as for full_state_dict).
        rank0_only: only global rank 0 receives (else every rank).
        timeout: the longest any wait may last (see full_state_dict).
        transport: as for :func:`shardgather.full_state_dict` for the dict verb; the
            stream moves buckets (``"auto"`` and ``"collective"``; ``"node-local"``
            cannot stream and is refused by it).
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
        keys: KeySelection | None = None,
        merge_adapter: str | None = None,
        bucket_mb: float | None = None,
        rank0_only: bool = True,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        transport: str = "auto",
        pin_memory: bool = False,
    ) -> None:
        self.model = check_model(model)
        self.keys = keys
        self.merge_adapter = merge_adapter
        self.options = Options(
            dtype=dtype,
            bucket_mb=bucket_mb,
            rank0_only=rank0_only,
            pin_memory=pin_memory,
            timeout=timeout,
            transport=transport,
        )
        self._held = Regions()
        self._outputs: dict[str, torch.Tensor] | None = None  # the dict verb's
        self._key: str | None = None  # plan fingerprint of _outputs
        self._sink = StreamSink(torch.device("cpu"))
        self._whole_slab: torch.Tensor | None = None  # iter_packed's, for whole tensors

    # ------------------------------------------------------------------------ dict

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """As :func:`shardgather.full_state_dict`, into the previous call's tensors.

        Returns:
            The same dict object every call (on the receiving ranks; ``{}`` elsewhere),
            its tensors overwritten in place: copy what you must keep.
        """
        opts = self.options
        merge = merge_transform(self.model, self.merge_adapter, self.keys)
        with Call("Gatherer.full_state_dict", opts.timeout) as call:
            plan = merge(build_plan(self.model, dtype=opts.dtype, keys=self.keys))
            if self._key != plan.fingerprint:
                self._outputs, self._key = None, plan.fingerprint
            primaries = None
            if self._outputs is not None:
                primaries = {k: self._outputs[k] for k in plan.entries}
            receives = not opts.rank0_only or call.rank == 0
            sink = HostDict(
                plan,
                receives=receives,
                pin_memory=opts.pin_memory,
                outputs=primaries,
                held=self._held,
            )
            got = run.gather(call, plan, sink, opts)
        if got is None:
            return {}
        fresh = with_aliases(plan, got)
        # Held regions or reused tensors: the same memory every call, so the same dict
        # (its views stay valid); refreshed in place if the memory changed (the model's
        # plan or the transport did).
        if self._outputs is None:
            self._outputs = fresh
        elif any(self._outputs[k].data_ptr() != t.data_ptr() for k, t in fresh.items()):
            self._outputs.clear()
            self._outputs.update(fresh)
        return self._outputs

    # ---------------------------------------------------------------------- stream

    def iter_full_tensors(
        self, *, owned: bool = False, device: torch.device | str = "cpu"
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(key, full tensor)`` for every entry of the model, bucket by bucket.

        Every rank must iterate to the end (or until an error), in lockstep: each
        bucket is one collective. Ranks that do not receive (``rank0_only``) yield
        nothing but take part in every gather. Tied weights are yielded once, under
        the first key. Keys are the plain model's. A consumer that raises or stops on
        one rank makes every other rank raise ``CollectiveError`` at once; the model
        is untouched and the next call works.

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
        opts = self.options
        sink = self._sink_on(device)
        merge = merge_transform(self.model, self.merge_adapter, self.keys)
        with Call("iter_full_tensors", opts.timeout) as call:
            if opts.transport == Transport.NODE_LOCAL:
                raise ShardGatherError(
                    "iter_full_tensors moves buckets: transport='node-local' applies to the "
                    "dict verb; use 'auto' or 'collective'"
                )
            plan = merge(build_plan(self.model, dtype=opts.dtype, keys=self.keys))
            sink.start(owned)
            try:
                for key, t in run.stream(call, plan, opts, sink.write_rows, sink.write_whole):
                    yield key, t
                    sink.handed_over(key)  # the consumer asked for the next one
            except GeneratorExit:
                call.fail(CollectiveError(_STOPPED))
                raise
            finally:
                sink.stop()

    def _sink_on(self, device: torch.device | str) -> StreamSink:
        """The stream sink, its buffers on ``device`` (made anew when that changes)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self._sink.device != device:
            self._sink = StreamSink(device)
        return self._sink

    def iter_packed(self, *, device: torch.device | str = "cpu") -> Iterator[PackedBucket]:
        """Yield the model's full tensors as :class:`PackedBucket` s, bucket by bucket.

        The copy-out op writes each gathered bucket's complete tensors straight from the
        gathered rows into one reused slab, back to back (cast if the gatherer has a
        ``dtype``): no intermediate full tensors, no ``torch.cat``. A tensor spread over
        several gathers comes as a bucket of its own once complete; tensors every rank
        holds whole (buffers, unsharded parameters) are packed first, in buckets of at
        most ``bucket_mb``. As :meth:`iter_full_tensors`: every rank iterates in
        lockstep, the gather of the next bucket is in flight while the consumer handles
        this one (two buffers: gathered rows and the slab), ``rank0_only`` ranks yield
        nothing, tied weights come once, and a buffer is valid until the next one is
        asked for.
        """
        opts = self.options
        merge = merge_transform(self.model, self.merge_adapter, self.keys)
        with Call("iter_packed", opts.timeout) as call:
            if opts.transport == Transport.NODE_LOCAL:
                raise ShardGatherError("iter_packed moves buckets: use transport 'auto'")
            plan = merge(build_plan(self.model, dtype=opts.dtype, keys=self.keys))
            yield from self.packed(call, plan, device)

    def packed(
        self, call: Call, plan: GatherPlan, device: torch.device | str = "cpu"
    ) -> Iterator[PackedBucket]:
        """:meth:`iter_packed` of ``plan`` within ``call`` (a verb built on it: the
        weight sender)."""
        opts = self.options
        sink = self._sink_on(device)
        device = sink.device
        local = {k for k, e in plan.entries.items() if e.source.group is None}
        limit = opts.bucket_bytes(device.type == "cuda")
        held: list[tuple[str, torch.Tensor]] = []
        pending: set[str] = set()
        sink.start(False)
        try:
            for key, t in run.stream(call, plan, opts, sink.write_rows, sink.write_whole):
                if key in local:
                    held.append((key, t))
                    continue
                if held:
                    yield from self._pack_whole(held, plan, limit, device)
                    held = []
                if key in sink.layout:
                    pending.add(key)
                    if len(pending) == len(sink.layout):
                        yield _packed(sink.slab, sink.layout, sink.used, plan)
                        pending = set()
                    continue
                e = plan.entries[key]
                flat = t.reshape(-1).view(torch.uint8)
                yield PackedBucket(flat, [key], [tuple(e.shape)], [e.target_dtype], [0], [e.nbytes])
                sink.handed_over(key)
            if held:
                yield from self._pack_whole(held, plan, limit, device)
        except GeneratorExit:
            call.fail(CollectiveError(_STOPPED))
            raise
        finally:
            sink.stop()

    def _pack_whole(
        self,
        held: list[tuple[str, torch.Tensor]],
        plan: GatherPlan,
        limit: int,
        device: torch.device,
    ) -> Iterator[PackedBucket]:
        """Tensors every rank holds whole, packed into a slab of their own (reused)."""
        align = StreamSink.ALIGN
        i = 0
        while i < len(held):
            layout: dict[str, int] = {}
            placed: list[tuple[torch.Tensor, int]] = []
            size = 0
            while i < len(held):
                key, t = held[i]
                at = (size + align - 1) // align * align
                if layout and at + t.numel() * t.element_size() > limit:
                    break
                layout[key] = at
                placed.append((t, at))
                size = at + t.numel() * t.element_size()
                i += 1
            if (
                self._whole_slab is None
                or self._whole_slab.numel() < size
                or (self._whole_slab.device != device)
            ):
                self._whole_slab = torch.empty(size, dtype=torch.uint8, device=device)
            for t, at in placed:
                dst = self._whole_slab[at : at + t.numel() * t.element_size()]
                dst.view(t.dtype).view(t.shape).copy_(t)
            yield _packed(self._whole_slab, layout, size, plan)

    def close(self) -> None:
        """Release what the gatherer holds (shared regions, slabs, kept tensors)."""
        self._held.close()
        self._outputs, self._key = None, None
        self._sink.close()
        self._whole_slab = None

    def __enter__(self) -> Gatherer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_full_tensors(
    model: nn.Module,
    *,
    dtype: torch.dtype | None = None,
    keys: KeySelection | None = None,
    merge_adapter: str | None = None,
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
    g = Gatherer(
        model,
        dtype=dtype,
        keys=keys,
        merge_adapter=merge_adapter,
        bucket_mb=bucket_mb,
        rank0_only=rank0_only,
        timeout=timeout,
    )
    try:
        yield from g.iter_full_tensors(owned=owned, device=device)
    finally:
        g.close()
