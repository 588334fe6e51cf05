"""Shared by the multi-process tests: sharded models built the same way on every
rank (with their plain twin), and bit-exact checks of what shardgather returns."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from .compare import diff_state_dicts
from .models import Block, TinyLM


def strategy(name: str):  # type: ignore[no-untyped-def]
    from torch.distributed.fsdp import ShardingStrategy

    return getattr(ShardingStrategy, name)


def apply_ac(model: nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))


def expected(plain: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    sd = plain.state_dict()
    if dtype is None:
        return sd
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}


def check(rank: int, got: dict, want: dict | None, rank0_only: bool, **kw) -> list[str]:  # type: ignore[type-arg]
    if rank0_only and rank != 0:
        return [] if got == {} else [f"rank {rank} got {len(got)} keys, expected {{}}"]
    assert want is not None
    problems = diff_state_dicts(got, want, **kw)
    # Tied weights: both keys, one tensor.
    if "lm_head.weight" in got and "embed.weight" in got and want["lm_head.weight"] is not None:
        tied = (
            want["lm_head.weight"].data_ptr() == want["embed.weight"].data_ptr()
            if (want is not None and isinstance(want["embed.weight"], torch.Tensor))
            else False
        )
        if tied and got["lm_head.weight"] is not got["embed.weight"]:
            problems.append("tied weights are not one shared tensor")
    return problems


def serializable(sd: dict) -> list[str]:  # type: ignore[type-arg]
    """What users do next with the dict must work: torch.save and safetensors."""
    import io

    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    if not sd:
        return []
    problems = []
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    problems += ["torch.save round trip: " + p for p in diff_state_dicts(back, sd)]
    untied = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    back = st_load(st_save({k: v.contiguous() for k, v in untied.items()}))
    problems += [
        "safetensors round trip: " + p for p in diff_state_dicts(back, untied, order=False)
    ]
    return problems


def recv_reference(got: dict, rank: int) -> dict:  # type: ignore[type-arg]
    """Rank 0's dict, broadcast: every rank must have received the same values."""
    obj = [got if rank == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    return obj[0]


def build(kind: str, world: int, seed: int, tied: bool = True) -> tuple[nn.Module, nn.Module]:
    """(sharded model, plain twin) for save/load round trips."""
    torch.manual_seed(seed)
    model = TinyLM(tied=tied, frozen_bf16=kind.endswith("-frozen"))
    plain = copy.deepcopy(model)
    if kind.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            device_id=torch.device("cpu"),
            use_orig_params=kind.endswith("orig"),
        ), plain
    if kind.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if kind == "fsdp2-hsdp":
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("r", "s"))
        else:
            mesh = init_device_mesh("cpu", (world,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, plain
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model), plain
    return model, plain


def same_osd(got: dict, want: dict, exact: bool) -> list[str]:  # type: ignore[type-arg]
    problems = []
    if set(got["state"]) != set(want["state"]):
        problems.append(f"state keys differ: {sorted(set(got['state']) ^ set(want['state']))}")
    for k in want["state"]:
        for name, v in want["state"][k].items():
            g = got["state"].get(k, {}).get(name)
            if g is None:
                problems.append(f"{k}.{name} missing")
            elif exact and not torch.equal(g, v):
                problems.append(f"{k}.{name} differs")
            elif not exact and not torch.allclose(g.double(), v.double(), atol=1e-5, rtol=1e-4):
                problems.append(f"{k}.{name} not close")
    gp = [
        {k: v for k, v in g.items() if k != "params"} | {"params": sorted(g["params"])}
        for g in got["param_groups"]
    ]
    wp = [
        {k: v for k, v in g.items() if k != "params"} | {"params": sorted(g["params"])}
        for g in want["param_groups"]
    ]
    if exact and gp != wp:
        problems.append(f"param groups differ: {gp} vs {wp}")
    return problems


def eval_loss(model: nn.Module, rank: int, step: int) -> float:
    """The loss on the next batch, in eval mode (so BatchNorm statistics stay put)."""
    from .models import batch

    model.eval()
    with torch.no_grad():
        loss = float(model(batch(rank, step)).float().pow(2).mean())
    model.train()
    return loss


def expected_cast(sd: dict) -> dict:  # type: ignore[type-arg]
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()}


def io_read_bytes() -> int:
    """Bytes this process read through read()/pread() (sockets included)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


# ------------------------------------------------------------------ N-D layouts
# kind: (world, mesh shape, mesh dim names). TinyLM(tied=False) under tensor parallelism
# (column-wise fc1 / lm_head, row-wise fc2 / embedding: the vocabulary, 37, splits
# unevenly; the MLP width is 36, since torch's TP forward cannot run an uneven
# row-wise matmul), with FSDP2 on top on the "dp" dims.
ND_KINDS = {
    "tp": (2, (2,), ("tp",)),
    "fsdp2-tp": (4, (2, 2), ("dp", "tp")),
    "fsdp2-tp-bf16": (4, (2, 2), ("dp", "tp")),
    "hsdp-tp": (8, (2, 2, 2), ("rep", "dp", "tp")),
    "replicate-tp": (4, (2, 2), ("dp", "tp")),
    "fsdp2-shard1": (2, (2,), ("dp",)),
    "fsdp2-ep": (4, (2, 2), ("dp", "ep")),
    "fsdp2": (4, (4,), ("dp",)),
    "plain": (1, (1,), ("dp",)),
}


def tp_plan(model: nn.Module) -> dict:  # type: ignore[type-arg]
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(len(model.blocks)):  # type: ignore[arg-type]
        plan[f"blocks.{i}.fc1"] = ColwiseParallel()
        plan[f"blocks.{i}.fc2"] = RowwiseParallel()
    return plan


def build_nd(kind: str, seed: int) -> tuple[nn.Module, nn.Module]:
    """(model laid out as ``kind``, its plain twin) on the current process group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    from .models import MoELM

    world, shape, names = ND_KINDS[kind]
    torch.manual_seed(seed)
    model: nn.Module = MoELM() if kind == "fsdp2-ep" else TinyLM(tied=False, hidden=36)
    plain = copy.deepcopy(model)
    if kind == "plain":
        return model, plain
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    if "tp" in names:
        parallelize_module(model, mesh["tp"], tp_plan(model))
    if kind == "fsdp2-ep":
        # Expert parallel as torchtitan lays it out: experts split over "ep" and sharded
        # by FSDP2 over "dp"; everything else sharded over every rank.
        everyone = init_device_mesh("cpu", (world,), mesh_dim_names=("all",))
        for b in model.blocks:  # type: ignore[union-attr]
            ex = b.experts
            for name in ("w1", "w2"):
                w = getattr(ex, name)
                setattr(ex, name, nn.Parameter(distribute_tensor(w.data, mesh["ep"], [Shard(0)])))
            fully_shard(ex, mesh=mesh["dp"])
            fully_shard(b, mesh=everyone)
        fully_shard(model, mesh=everyone)
        return model, plain
    if kind == "replicate-tp":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(model, mesh=mesh["dp"])
        return model, plain
    dp = {"hsdp-tp": ("rep", "dp")}.get(kind, ("dp",))
    if "dp" not in names:
        return model, plain
    kw: dict = {"mesh": mesh[dp] if len(dp) > 1 else mesh[dp[0]]}
    if kind.endswith("bf16"):
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, output_dtype=torch.float32
        )
    if kind == "fsdp2-shard1":  # FSDP2 on dim 1 where it divides evenly
        kw["shard_placement_fn"] = lambda p: (
            Shard(1) if p.ndim == 2 and p.shape[1] % 2 == 0 else None
        )
    for b in model.blocks:  # type: ignore[union-attr]
        fully_shard(b, **kw)
    kw.pop("mp_policy", None)  # BatchNorm and the head stay in fp32 (they take fp32 input)
    fully_shard(model, **kw)
    return model, plain


def local_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's local tensor here (what a rank holds), by the plain name."""
    from shardgather import clean_fqn

    out = {}
    for name, p in model.named_parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        out[clean_fqn(name)] = t.detach().clone()
    return out
