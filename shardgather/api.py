"""The public entry points: full_state_dict (and, in io/, save/load)."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import _layout as L
from . import _node_local, _ops, _staging
from ._collectives import (
    agree,
    bucket_parts,
    gather_buckets,
    my_buckets,
    receiving,
    use_gather,
)
from ._options import DEFAULT_TIMEOUT, Progress, default_bucket_mb, verify_options, verify_transport
from ._pieces import copy_local
from ._plan import GatherPlan, build_plan, memory_order_flat


def all_ok(ok: bool, message: str) -> list[str]:
    """Every rank's failure message (empty when all succeeded). Best effort when a rank died."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [] if ok else [message]
    out: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(out, (ok, message))
    except Exception as exc:
        return [f"a rank is unreachable ({exc})"]
    return [f"rank {r}: {m}" for r, (o, m) in enumerate(out) if not o]


def full_state_dict(
    model: nn.Module,
    *,
    rank0_only: bool = True,
    dtype: torch.dtype | None = None,
    bucket_mb: float | None = None,
    pin_memory: bool = False,
    progress: bool = False,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    transport: str = "auto",
) -> dict[str, torch.Tensor]:
    """The full, unwrapped state dict of a (sharded) model, on CPU.

    Call it on every rank. Keys are exactly the plain model's ``state_dict()`` keys
    (no ``_fsdp_wrapped_module.``, ``_flat_param``, ``_checkpoint_wrapped_module.``,
    ``module.``, ``_orig_mod.``); values are the full-precision stored parameters and
    the buffers, bit-identical, in their own dtype unless ``dtype`` asks for a cast.
    Tied parameters appear under every key and share one tensor.

    Args:
        model: FSDP1 (any sharding strategy), FSDP2 (``fully_shard``, 1-D or HSDP),
            or a plain / DDP / ``torch.compile``'d module (no process group needed).
        rank0_only: only global rank 0 gets the dict, the others get ``{}``; with
            HSDP only rank 0's replica gathers. False: every rank gets it.
        dtype: cast floating-point tensors to this dtype (fused into the copy-out).
        bucket_mb: gathered MiB per collective; peak extra memory is about two buckets.
            Default: 16 on CPU (gloo; bigger buckets only add page faults and stall the
            pipeline, measured in bench/), 256 on CUDA.
        pin_memory: return pinned tensors (fast later host-to-device copies).
        progress: show a tqdm bar of bytes on the receiving rank(s).
        timeout: per-collective timeout; a failed or missing rank raises instead of
            hanging.
        transport: ``"auto"`` (with ``rank0_only`` and without ``pin_memory``): each
            rank on rank 0's host writes its own pieces straight into one shared-memory
            region per dtype that becomes the output (the output tensors are views of
            it, freed with the last one; CUDA shards go through the copy-out kernel
            and a pinned slab per rank, so every GPU uses its own link); ranks on other
            hosts send only their pieces to rank 0. Otherwise bucketed collectives.
            ``"node-local"``: ask for the former (warns once and falls back when impossible,
            e.g. no memfd shareable and /dev/shm too small). ``"collective"``: always the
            latter.

    Returns:
        ``dict[str, Tensor]``: CPU tensors with the plain model's shapes and strides.

    Raises:
        ShardGatherError: bad arguments.
        UnsupportedModelError: tensor-parallel or non-dim-0 sharded parameters.
        CollectiveError: ranks disagree about the model, or a collective failed.

    Example:
        >>> sd = shardgather.full_state_dict(fsdp_model)   # on every rank
        >>> if dist.get_rank() == 0:
        ...     plain_model.load_state_dict(sd)
    """
    verify_options(model, bucket_mb, dtype)
    verify_transport(transport, pin_memory)
    plan = build_plan(model, dtype=dtype)
    agree(plan, timeout)
    outputs = gather_plan(
        plan,
        rank0_only=rank0_only,
        bucket_mb=bucket_mb,
        pin_memory=pin_memory,
        progress=progress,
        timeout=timeout,
        transport=transport,
    )
    if outputs is None:
        return {}
    return {k: outputs[plan.aliases.get(k, k)] for k in plan.keys}


def gather_plan(
    plan: GatherPlan,
    *,
    rank0_only: bool,
    bucket_mb: float | None,
    pin_memory: bool = False,
    progress: bool = False,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    transport: str = "auto",
    outputs: dict[str, torch.Tensor] | None = None,
    held: _node_local.HeldRegions | None = None,
) -> dict[str, torch.Tensor] | None:
    """The engine: every primary entry of an agreed plan, gathered; None where this rank
    receives nothing. Model and optimizer state share it. Reuse (a Gatherer's): ``held``
    keeps the node-local regions open for the next call; ``outputs``, the previous
    call's tensors (same plan), are written again on the collective path."""
    bucket_mb = bucket_mb if bucket_mb is not None else default_bucket_mb(plan)
    if not pin_memory and _node_local.choose(
        plan,
        transport,
        rank0_only,
        need_contiguous=False,
        shm_bytes=sum(_node_local.shm_layout(plan)[1].values()),
    ):
        return _node_local.gather_to_shm(
            plan,
            lambda i: 0 in plan.sources[i].group_ranks,
            copy_local,
            timeout,
            all_ok,
            message_bytes=int(bucket_mb * 2**20),
            held=held,
        )
    if held is not None:
        held.close()  # regions of an earlier node-local call: not written any more
    receives = receiving(plan, rank0_only)
    if outputs is None:
        outputs = {}
        if receives:
            for key, e in plan.entries.items():
                outputs[key] = torch.empty_strided(
                    tuple(e.shape), e.stride, dtype=e.target_dtype, pin_memory=pin_memory
                )
    total = sum(e.nbytes for e in plan.entries.values())
    bar = Progress(progress and receives, total, "shardgather: gather")
    try:
        if receives:
            for key, e in plan.entries.items():
                if e.source.group is None:
                    copy_local(e.source.local(), e, outputs[key])
                    bar.update(e.nbytes)
        buckets = my_buckets(plan, bucket_mb, rank0_only)
        by_source = plan.entries_by_source()
        slot = 0
        for bucket, rows in gather_buckets(
            buckets,
            lambda b: receives,
            timeout=timeout,
            use_gather=use_gather(buckets, rank0_only),
        ):
            if rows is None:
                continue
            parts = bucket_parts(bucket, by_source)
            if rows.is_cuda:
                _copy_out_cuda(rows, parts, outputs, slot)
                slot ^= 1
            else:
                _copy_out_direct(rows, parts, outputs)
            bar.update(sum(p.numel * p.entry.target_dtype.itemsize for p in parts))
    finally:
        bar.close()
    return outputs if receives else None


def _copy_out_direct(rows: torch.Tensor, parts: list, outputs: dict[str, torch.Tensor]) -> None:
    """One copy_out call per bucket, straight into the output tensors (CPU outputs from
    CPU rows; pinned outputs, through their mapped addresses, from CUDA rows)."""
    fulls: list[torch.Tensor] = []
    index: dict[str, int] = {}
    segs: list[L.Segment] = []
    for p in parts:
        if p.entry.key not in index:
            index[p.entry.key] = len(fulls)
            fulls.append(memory_order_flat(outputs[p.entry.key]))
        segs.append(p.segment.with_dst(index[p.entry.key], p.start * p.entry.target_dtype.itemsize))
    _ops.copy_out(rows, 0, L.segment_table(segs), fulls)


def _copy_out_cuda(
    rows: torch.Tensor, parts: list, outputs: dict[str, torch.Tensor], slot: int
) -> None:
    """Device rows -> (kernel, writing mapped pinned memory) -> outputs.

    Pinned outputs are written directly; pageable ones through a reused pinned slab
    and a host memcpy once the kernel is done.
    """
    if all(outputs[p.entry.key].is_pinned() for p in parts):
        _copy_out_direct(rows, parts, outputs)
        torch.cuda.current_stream(rows.device).synchronize()
        return
    sizes = [p.numel * p.entry.target_dtype.itemsize for p in parts]
    staging = _staging.slab(slot, sum(sizes) + 16 * len(parts))
    segs = []
    offsets = []
    off = 0
    for p, n in zip(parts, sizes):
        off = (off + 15) // 16 * 16
        offsets.append(off)
        segs.append(p.segment.with_dst(0, off))
        off += n
    _ops.copy_out(rows, 0, L.segment_table(segs), [staging])
    torch.cuda.current_stream(rows.device).synchronize()
    for p, n, o in zip(parts, sizes, offsets):
        out = memory_order_flat(outputs[p.entry.key]).view(torch.uint8)
        b = p.start * p.entry.target_dtype.itemsize
        out[b : b + n].copy_(staging[o : o + n])
