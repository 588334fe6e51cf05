"""Worker-side scenarios for the distributed tests (run by dist_harness.run).

Each builds a real FSDP model, gathers it with shardgather, and returns (from rank 0)
the problems found against the oracles: the plain model built from the same seed
(before training) and torch's own full state dict (after training steps).
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
from torch import nn

import shardgather as sg

from .compare import diff_state_dicts
from .models import Block, ConvNet, TinyLM, make_optimizer, train_steps

FSDP1_CASES = {
    # id: (world, kwargs)
    "full_shard": (2, {}),
    "full_shard-orig_params": (2, {"use_orig_params": True}),
    "shard_grad_op": (2, {"strategy": "SHARD_GRAD_OP"}),
    "shard_grad_op-orig_params": (2, {"strategy": "SHARD_GRAD_OP", "use_orig_params": True}),
    "no_shard": (2, {"strategy": "NO_SHARD"}),
    "world3": (3, {}),
    "world3-orig_params": (3, {"use_orig_params": True}),
    # torch's FSDP1 CPUOffload pins memory at lazy init, which needs a GPU: on a
    # CPU-only machine only the state before the first forward can be checked.
    "cpu_offload-before_forward": (2, {"cpu_offload": True, "train": False}),
    "mixed_precision": (2, {"mixed_precision": True}),
    "ignored_modules": (2, {"ignored": True}),
    "non_fsdp_root": (2, {"non_fsdp_root": True}),
    "ac_inside": (2, {"ac": "inside"}),
    "ac_outside": (2, {"ac": "outside"}),
    "untied": (2, {"tied": False}),
    "no_autowrap": (2, {"autowrap": False}),
    "hybrid_shard": (4, {"strategy": "HYBRID_SHARD"}),
    "hybrid_shard_zero2": (4, {"strategy": "_HYBRID_SHARD_ZERO2"}),
    "compiled": (2, {"compile": True}),
    "small_bucket": (2, {"bucket_mb": 0.0005, "transport": "collective"}),
    "bf16_cast": (2, {"dtype": torch.bfloat16}),
    "all_ranks": (2, {"rank0_only": False}),
    # The default transport on one host is node-local; these pin the collective path.
    "collective": (2, {"transport": "collective"}),
    "collective-world3-orig_params": (3, {"use_orig_params": True, "transport": "collective"}),
    "collective-hybrid_shard": (4, {"strategy": "HYBRID_SHARD", "transport": "collective"}),
    "collective-bf16_cast": (2, {"dtype": torch.bfloat16, "transport": "collective"}),
    "collective-mixed_precision": (2, {"mixed_precision": True, "transport": "collective"}),
}

FSDP2_CASES = {
    "1d": (2, {}),
    "1d-world3": (3, {}),
    "no_reshard": (2, {"reshard_after_forward": False}),
    "mixed_dtype": (2, {"frozen_bf16": True}),
    "cpu_offload": (2, {"cpu_offload": True}),
    "hsdp": (4, {"hsdp": True}),
    "hsdp-all_ranks": (4, {"hsdp": True, "rank0_only": False}),
    "untied": (2, {"tied": False}),
    "ac_inside": (2, {"ac": "inside"}),
    "small_bucket": (2, {"bucket_mb": 0.0005, "transport": "collective"}),
    "bf16_cast": (2, {"dtype": torch.bfloat16}),
    "collective": (2, {"transport": "collective"}),
    "collective-world3": (3, {"transport": "collective"}),
    "collective-hsdp": (4, {"hsdp": True, "transport": "collective"}),
    "collective-mixed_dtype": (2, {"frozen_bf16": True, "transport": "collective"}),
}


def _strategy(name: str):  # type: ignore[no-untyped-def]
    from torch.distributed.fsdp import ShardingStrategy

    return getattr(ShardingStrategy, name)


def _apply_ac(model: nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))


def _expected(plain: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    sd = plain.state_dict()
    if dtype is None:
        return sd
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}


def _check(rank: int, got: dict, want: dict | None, rank0_only: bool, **kw) -> list[str]:  # type: ignore[type-arg]
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


def fsdp1_case(rank: int, world: int, case: str) -> dict:  # type: ignore[type-arg]
    from torch.distributed.fsdp import (
        CPUOffload,
        FullStateDictConfig,
        MixedPrecision,
        StateDictType,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    _, kw = FSDP1_CASES[case]
    torch.manual_seed(0)
    model = TinyLM(tied=kw.get("tied", True))
    if kw.get("ac") == "inside":
        _apply_ac(model)
    plain = copy.deepcopy(model)
    fsdp_kwargs: dict = {
        "device_id": torch.device("cpu"),
        "use_orig_params": kw.get("use_orig_params", False),
        "sharding_strategy": _strategy(kw.get("strategy", "FULL_SHARD")),
    }
    if kw.get("autowrap", True):
        fsdp_kwargs["auto_wrap_policy"] = ModuleWrapPolicy({Block})
    if "HYBRID" in kw.get("strategy", ""):
        from torch.distributed.device_mesh import init_device_mesh

        fsdp_kwargs["device_mesh"] = init_device_mesh("cpu", (2, world // 2))
    if kw.get("cpu_offload"):
        fsdp_kwargs["cpu_offload"] = CPUOffload(offload_params=True)
    if kw.get("mixed_precision"):
        fsdp_kwargs["mixed_precision"] = MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16
        )
    if kw.get("ignored"):
        fsdp_kwargs["ignored_modules"] = [model.bn]
    if kw.get("non_fsdp_root"):
        for i, b in enumerate(model.blocks):
            model.blocks[i] = FSDP(
                b, **{k: v for k, v in fsdp_kwargs.items() if k != "auto_wrap_policy"}
            )
        wrapped: nn.Module = model
    else:
        wrapped = FSDP(model, **fsdp_kwargs)
    if kw.get("ac") == "outside":
        _apply_ac(wrapped)
    if kw.get("compile"):
        wrapped = torch.compile(wrapped)
    opts = {
        "rank0_only": kw.get("rank0_only", True),
        "bucket_mb": kw.get("bucket_mb"),
        "dtype": kw.get("dtype"),
        "transport": kw.get("transport", "auto"),
    }

    # 1. Right after wrapping (lazy init not run): the plain model is the oracle.
    got = sg.full_state_dict(wrapped, **opts)
    problems = [
        "before training: " + p
        for p in _check(rank, got, _expected(plain, opts["dtype"]), opts["rank0_only"])
    ]
    problems += _serializable(got)

    if not kw.get("train", True):
        return {"problems": problems, "keys": len(got)}
    # 2. After training steps: torch's FULL_STATE_DICT is the oracle.
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    train_steps(wrapped, rank, 2, opt)
    got = sg.full_state_dict(wrapped, **opts)
    if not kw.get("non_fsdp_root"):
        fsdp_root = wrapped._orig_mod if kw.get("compile") else wrapped
        with FSDP.state_dict_type(
            fsdp_root,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
        ):
            ref = fsdp_root.state_dict()
        ref = {sg.clean_fqn(k): v for k, v in ref.items()}
        if rank == 0:
            if opts["dtype"] is not None:
                ref = {
                    k: v.to(opts["dtype"]) if v.is_floating_point() else v for k, v in ref.items()
                }
            # torch's FSDP1 re-registers tied/flattened params, so its key order is not
            # the plain model's: compare its values, and our order against the plain model.
            problems += [
                "after training vs torch: " + p
                for p in diff_state_dicts(got, ref, order=False, strides=False)
            ]
            plain_keys = list(plain.state_dict())
            if list(got) != plain_keys:
                problems.append(f"key order != plain model: {list(got)} vs {plain_keys}")
        elif opts["rank0_only"] and got != {}:
            problems.append(f"rank {rank} got a non-empty dict")
    # 3. Training continues bit-identically: one more step works and params still shard.
    train_steps(wrapped, rank, 1, opt)
    return {"problems": problems, "keys": len(got)}


def _serializable(sd: dict) -> list[str]:  # type: ignore[type-arg]
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


def fsdp1_channels_last(rank: int, world: int) -> dict:  # type: ignore[type-arg]
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = ConvNet()
    plain = copy.deepcopy(model)
    wrapped = FSDP(model, device_id=torch.device("cpu"))
    got = sg.full_state_dict(wrapped)
    return {"problems": _check(rank, got, plain.state_dict(), True)}


def fsdp2_case(rank: int, world: int, case: str) -> dict:  # type: ignore[type-arg]
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    _, kw = FSDP2_CASES[case]
    torch.manual_seed(0)
    model = TinyLM(tied=kw.get("tied", True), frozen_bf16=kw.get("frozen_bf16", False))
    if kw.get("ac") == "inside":
        _apply_ac(model)
    plain = copy.deepcopy(model)
    if kw.get("hsdp"):
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    shard_kw: dict = {"mesh": mesh, "reshard_after_forward": kw.get("reshard_after_forward", True)}
    if kw.get("cpu_offload"):
        shard_kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for b in model.blocks:
        fully_shard(b, **shard_kw)
    fully_shard(model, **shard_kw)
    opts = {
        "rank0_only": kw.get("rank0_only", True),
        "bucket_mb": kw.get("bucket_mb"),
        "dtype": kw.get("dtype"),
        "transport": kw.get("transport", "auto"),
    }
    got = sg.full_state_dict(model, **opts)
    problems = [
        "before training: " + p
        for p in _check(rank, got, _expected(plain, opts["dtype"]), opts["rank0_only"])
    ]
    problems += _serializable(got)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    train_steps(model, rank, 2, opt)
    if kw.get("reshard_after_forward") is False:
        # Leave the params unsharded at call time: a forward without backward.
        with torch.no_grad():
            model(torch.zeros(2, 3, dtype=torch.long))
    with torch.no_grad():
        got = sg.full_state_dict(model, **opts)
    ref = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        if opts["dtype"] is not None:
            ref = {k: v.to(opts["dtype"]) if v.is_floating_point() else v for k, v in ref.items()}
        problems += ["after training vs torch: " + p for p in diff_state_dicts(got, ref)]
    elif opts["rank0_only"] and got != {}:
        problems.append(f"rank {rank} got a non-empty dict")
    if not opts["rank0_only"]:
        # Every rank must hold rank 0's dict (a collective: every rank calls it).
        # Buffers (BatchNorm statistics) are each rank's own: FSDP does not sync them.
        params = {k for k, _ in plain.named_parameters(remove_duplicate=False)}
        rank0 = {k: v for k, v in _recv_reference(got, rank).items() if k in params}
        problems += [
            f"rank {rank}: " + p
            for p in diff_state_dicts({k: v for k, v in got.items() if k in params}, rank0)
        ]
    train_steps(model, rank, 1, opt)
    return {"problems": problems, "keys": len(got)}


def _recv_reference(got: dict, rank: int) -> dict:  # type: ignore[type-arg]
    """Rank 0's dict, broadcast: every rank must have received the same values."""
    obj = [got if rank == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    return obj[0]


def ddp_case(rank: int, world: int) -> dict:  # type: ignore[type-arg]
    torch.manual_seed(0)
    model = TinyLM()
    plain = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    got = sg.full_state_dict(ddp)
    return {"problems": _check(rank, got, plain.state_dict(), True)}


def mismatched_models(rank: int, world: int) -> dict:  # type: ignore[type-arg]
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = FSDP(TinyLM(d=12 if rank == 0 else 16), device_id=torch.device("cpu"))
    try:
        sg.full_state_dict(model)
    except sg.CollectiveError as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None}


def rank_fails_midway(rank: int, world: int) -> dict:  # type: ignore[type-arg]
    """Rank 1 dies after the plan agreement: every other rank must raise, not hang."""
    import datetime
    import os

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from shardgather import _collectives

    torch.manual_seed(0)
    model = FSDP(TinyLM(), device_id=torch.device("cpu"))
    if rank == 1:
        orig = _collectives.gather_buckets

        @functools.wraps(orig)
        def dying(*a, **k):  # type: ignore[no-untyped-def]
            torch.save({"raised": "died"}, os.environ.get("SG_DUMMY", "/dev/null"))
            os._exit(3)
            yield  # pragma: no cover

        import shardgather.api

        shardgather.api.gather_buckets = dying
    try:
        sg.full_state_dict(model, timeout=datetime.timedelta(seconds=20), transport="collective")
    except sg.CollectiveError as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None}


def _build(kind: str, world: int, seed: int, tied: bool = True) -> tuple[nn.Module, nn.Module]:
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


def save_then_load(
    rank: int,
    world: int,
    path: str,
    save_kind: str,
    load_kind: str,
    dtype: torch.dtype | None = None,
    small_bucket: bool = False,
    transport: str = "auto",
) -> dict:  # type: ignore[type-arg]
    """Save from one configuration (seed 0, trained), load into another (seed 1), and
    compare what the loaded model gathers with what was saved."""
    saved, _ = _build(save_kind, world, seed=0)
    opt = torch.optim.SGD(saved.parameters(), lr=0.1)
    train_steps(saved, rank, 1, opt)
    want = sg.full_state_dict(saved)
    sg.save_full_state_dict(
        saved,
        path,
        dtype=dtype,
        metadata={"step": "1"},
        bucket_mb=0.001 if small_bucket else None,
        transport=transport,
    )
    problems: list[str] = []
    if rank == 0:
        from safetensors.torch import load_file

        raw = load_file(path)  # safetensors itself reads it
        file_sd = sg.load_file(path)
        want_file = {
            k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v)
            for k, v in want.items()
        }
        problems += ["file: " + p for p in diff_state_dicts(file_sd, want_file, order=False)]
        if "lm_head.weight" in raw:
            problems.append("tied weight stored twice")
    loaded, _ = _build(load_kind, world, seed=1)
    res = sg.load_full_state_dict(loaded, path)
    got = sg.full_state_dict(loaded)
    if rank == 0:
        expect = (
            want
            if dtype is None
            else {
                k: (v.to(dtype).to(v.dtype) if v.is_floating_point() else v)
                for k, v in want.items()
            }
        )
        problems += ["loaded: " + p for p in diff_state_dicts(got, expect, order=False)]
        problems += [f"unexpected result {res}"] if res.missing_keys or res.unexpected_keys else []
    # The loaded model trains.
    train_steps(loaded, rank, 1, torch.optim.SGD(loaded.parameters(), lr=0.1))
    return {"problems": problems}


def load_errors(rank: int, world: int, path: str) -> dict:  # type: ignore[type-arg]
    """Bad files and mismatches raise clear errors and modify nothing."""
    import os

    model, _ = _build("fsdp1", world, seed=0)
    before = sg.full_state_dict(model, rank0_only=False)
    out: dict = {}
    torch.manual_seed(3)
    sg.save_full_state_dict(TinyLM(n_layers=4), path)  # blocks.3.* are unexpected
    for name, fn in {
        "unexpected_key": lambda: sg.load_full_state_dict(model, path),
        "missing_file": lambda: sg.load_full_state_dict(model, path + ".nope"),
    }.items():
        try:
            fn()
            out[name] = None
        except sg.ShardGatherError as exc:
            out[name] = (type(exc).__name__, str(exc))
    after = sg.full_state_dict(model, rank0_only=False)
    out["unchanged_by_errors"] = not diff_state_dicts(after, before)
    res = sg.load_full_state_dict(model, path, strict=False)
    out["non_strict"] = (res.missing_keys, res.unexpected_keys)
    loaded = sg.full_state_dict(model, rank0_only=False)
    torch.manual_seed(3)
    want = TinyLM(n_layers=4).state_dict()
    out["non_strict_loaded"] = not diff_state_dicts(
        loaded, {k: v for k, v in want.items() if k in loaded}, order=False
    )
    if rank == 0:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 10)
    dist.barrier()
    try:
        sg.load_full_state_dict(model, path)
        out["truncated"] = None
    except sg.ShardGatherError as exc:
        out["truncated"] = (type(exc).__name__, str(exc))
    return out


def save_fails_on_one_rank(rank: int, world: int, path: str, transport: str) -> dict:  # type: ignore[type-arg]
    """The writer's disk fills up mid-stream: every rank raises, nothing is left."""
    import errno
    import os

    from shardgather import _pieces, _save
    from shardgather._plan import build_plan

    model, _ = _build("fsdp1", world, seed=0)
    if rank == 0:
        # Fail on the second write of gathered data (a bucket on the collective path, a
        # piece on the node-local one), after the unsharded entries went through.
        unsharded = sum(1 for e in build_plan(model).entries.values() if e.source.group is None)
        calls = [0]

        def full_disk(real):  # type: ignore[no-untyped-def]
            def write(*a, **k):  # type: ignore[no-untyped-def]
                calls[0] += 1
                if calls[0] > unsharded + 1:
                    raise OSError(errno.ENOSPC, "No space left on device (simulated)")
                return real(*a, **k)

            return write

        _save.pwrite_from = full_disk(_save.pwrite_from)
        _pieces.pwrite_from = full_disk(_pieces.pwrite_from)
    try:
        if transport == "auto-directory":
            sg.save_full_state_dict(model, path, bucket_mb=0.001, max_shard_size=2000)
        else:
            sg.save_full_state_dict(model, path, bucket_mb=0.001, transport=transport)
        raised = None
    except sg.ShardGatherError as exc:
        raised = (type(exc).__name__, str(exc))
    leftovers = sorted(os.listdir(os.path.dirname(path)))
    return {"raised": raised, "leftovers": leftovers, "writes": calls[0] if rank == 0 else None}


def save_into_missing_dir(rank: int, world: int, path: str, transport: str) -> dict:  # type: ignore[type-arg]
    """Rank 0 cannot create the file (no such directory): every rank raises the same
    CheckpointError at once, none is left waiting in a collective."""
    import datetime

    model, _ = _build("fsdp2", world, seed=0)
    timeout = datetime.timedelta(seconds=60)
    try:
        if transport == "checkpoint":
            sg.save_checkpoint(path, model, timeout=timeout)
        else:
            sg.save_full_state_dict(model, path, transport=transport, timeout=timeout)
        return {"raised": None}
    except sg.ShardGatherError as exc:
        return {"raised": (type(exc).__name__, str(exc))}


def memory_bounds(rank: int, world: int, path: str, size_gb: float, bucket_mb: float) -> dict:  # type: ignore[type-arg]
    """Peak RSS rise of full_state_dict / save / load on a model many buckets large."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from shardgather._memory import peak_rss_rise, trim
    from shardgather.testing import Block as GPTBlock
    from shardgather.testing import build_gpt

    model = FSDP(
        build_gpt(size_gb),
        auto_wrap_policy=ModuleWrapPolicy({GPTBlock}),
        device_id=torch.device("cpu"),
    )
    trim()
    out: dict = {}
    sg.full_state_dict(model, bucket_mb=bucket_mb)  # warm-up: first-call allocations
    with peak_rss_rise() as m:
        sd = sg.full_state_dict(model, bucket_mb=bucket_mb)
    out["gather_rise"] = m["peak_rise"]
    out["out_bytes"] = sum(
        v.numel() * v.element_size() for k, v in sd.items() if k != "lm_head.weight"
    )
    del sd
    trim()
    with peak_rss_rise() as m:
        sg.save_full_state_dict(model, path, bucket_mb=bucket_mb)
    out["save_rise"] = m["peak_rise"]
    trim()
    with peak_rss_rise() as m:
        sg.load_full_state_dict(model, path, bucket_mb=bucket_mb)
    out["load_rise"] = m["peak_rise"]
    out["file_bytes"] = __import__("os").path.getsize(path)
    # The Hugging Face layout: the same bound, whatever the number of files.
    hf = path + ".hf"
    trim()
    with peak_rss_rise() as m:
        sg.save_full_state_dict(model, hf, bucket_mb=bucket_mb, max_shard_size=50 * 2**20)
    out["hf_save_rise"] = m["peak_rise"]
    trim()
    with peak_rss_rise() as m:
        sg.load_full_state_dict(model, hf, bucket_mb=bucket_mb)
    out["hf_load_rise"] = m["peak_rise"]
    out["hf_files"] = len(__import__("os").listdir(hf))
    # A DCP directory torch wrote from the sharded model: the same bound (chunks located
    # from their zip directories, each rank reading its own elements only).
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    dcp_dir = path + ".dcp"
    dcp.save(get_model_state_dict(model), checkpoint_id=dcp_dir)
    trim()
    with peak_rss_rise() as m:
        sg.load_full_state_dict(model, dcp_dir, bucket_mb=bucket_mb)
    out["dcp_load_rise"] = m["peak_rise"]
    # save_checkpoint with optimizer state (2x the model) stays within the same bound.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)
    trim()
    with peak_rss_rise() as m:
        sg.save_checkpoint(path + ".ckpt", model, opt)
    out["checkpoint_rise"] = m["peak_rise"]
    # Loading an optimizer state that only rank 0 holds: the other ranks never hold more
    # of it than their slice of one tensor at a time (besides their own new shards).
    from shardgather._plan import build_plan

    osd = sg.full_optim_state_dict(model, opt)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-4)
    trim()
    with peak_rss_rise() as m:
        sg.load_full_optim_state_dict(model, fresh, osd)
    out["optim_load_rise"] = m["peak_rise"]
    out["own_state_bytes"] = sum(
        t.numel() * t.element_size()
        for st in fresh.state.values()
        for t in st.values()
        if isinstance(t, torch.Tensor)
    )
    out["largest_tensor_bytes"] = max(e.nbytes for e in build_plan(model).entries.values())
    # A checkpoint directory into a fresh optimizer: every rank preads only its own
    # elements of each state tensor from optim.safetensors (what Lightning's strategies
    # run on resume).
    again = torch.optim.AdamW(model.parameters(), lr=1e-4)
    trim()
    with peak_rss_rise() as m:
        sg.load_checkpoint(path + ".ckpt", model, again)
    out["checkpoint_load_rise"] = m["peak_rise"]
    out["osd_bytes"] = sum(
        t.numel() * t.element_size()
        for st in osd.get("state", {}).values()
        for t in st.values()
        if isinstance(t, torch.Tensor)
    )
    return out


def node_local_rank_dies(rank: int, world: int) -> dict:  # type: ignore[type-arg]
    """Rank 1 dies while writing its pieces: rank 0 raises; /dev/shm keeps nothing."""
    import datetime
    import os

    from shardgather import _pieces

    model, _ = _build("fsdp1", world, seed=0)
    before = set(os.listdir("/dev/shm"))
    if rank == 1:

        def die(*a, **k):  # type: ignore[no-untyped-def]
            os._exit(3)

        _pieces.write_pieces = die
    try:
        sg.full_state_dict(model, transport="node-local", timeout=datetime.timedelta(seconds=30))
        raised = None
    except sg.ShardGatherError as exc:
        raised = type(exc).__name__
    leaked = sorted(set(os.listdir("/dev/shm")) - before)
    return {"raised": raised, "leaked": [n for n in leaked if n.startswith("shardgather")]}


def shm_too_small(rank: int, world: int, memfd: bool) -> dict:  # type: ignore[type-arg]
    """/dev/shm without room: a memfd needs none (same result, node-local); without a
    shareable memfd, a one-line warning and the collective path, same result."""
    import warnings

    from shardgather import _node_local

    model, plain = _build("fsdp2", world, seed=0)
    _node_local.shm_free_bytes = lambda: 0
    if not memfd:
        _node_local.memfd_shareable = lambda: False  # e.g. ranks in other pid namespaces
    from shardgather import _forward

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = sg.full_state_dict(model, transport="node-local")
    msgs = [str(w.message) for w in caught if "node-local" in str(w.message)]
    if _forward.STATS["sent"] or _forward.STATS["received"]:
        msgs.append(f"one host, yet pieces travelled point to point: {_forward.STATS}")
    problems = _check(rank, got, plain.state_dict(), True)
    # Node-local outputs are views of a mapped region; the collective path's are not.
    node_local = rank == 0 and got["embed.weight"].untyped_storage().filename is not None
    return {"warnings": msgs if rank == 0 else [], "problems": problems, "node_local": node_local}


OPTIM_CASES = {
    # id: (world, save kind, resume kind, optimizer)
    "fsdp1-adamw": (2, "fsdp1", "fsdp1", "adamw"),
    "fsdp1_orig-adamw": (2, "fsdp1-orig", "fsdp1-orig", "adamw"),
    "fsdp2-adamw": (2, "fsdp2", "fsdp2", "adamw"),
    "fsdp2-sgd_momentum": (2, "fsdp2", "fsdp2", "sgd"),
    "fsdp1-world3-adam": (3, "fsdp1", "fsdp1", "adam"),
    "fsdp1_orig-world3-sgd_momentum": (3, "fsdp1-orig", "fsdp1-orig", "sgd"),
    "hsdp-adamw": (4, "fsdp2-hsdp", "fsdp2-hsdp", "adamw"),
    "fsdp1->fsdp2-adamw": (2, "fsdp1-orig", "fsdp2", "adamw"),
    # Resume a sharded run as a DDP one (every rank loads the whole state).
    "fsdp2->ddp-adamw": (2, "fsdp2", "ddp", "adamw"),
    # A frozen bf16 parameter next to trainable fp32 ones: it has no optimizer state.
    "fsdp2_frozen_bf16-adamw": (2, "fsdp2-frozen", "fsdp2-frozen", "adamw"),
}


def _same_osd(got: dict, want: dict, exact: bool) -> list[str]:  # type: ignore[type-arg]
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


def optim_resume(rank: int, world: int, path: str, case: str) -> dict:  # type: ignore[type-arg]
    """Run A trains N+M steps; run B trains N, saves model + optimizer, is thrown away;
    a fresh model C (other seed) loads both and trains M: C must equal A."""
    _, save_kind, resume_kind, opt_name = OPTIM_CASES[case]
    exact = save_kind == resume_kind
    n, m = 2, 2
    a, _ = _build(save_kind, world, seed=0)
    oa = make_optimizer(a, opt_name)
    train_steps(a, rank, n + m, oa)
    a_sd = sg.full_state_dict(a)
    a_osd = sg.full_optim_state_dict(a, oa)
    problems: list[str] = []
    if save_kind.startswith("fsdp2"):
        # torch's own full optimizer state dict as an oracle (FSDP2: correct on CPU).
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        ref = get_optimizer_state_dict(
            a, oa, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank == 0:
            problems += ["vs torch: " + p for p in _same_osd(a_osd, ref, exact=True)]
    del a, oa

    b, _ = _build(save_kind, world, seed=0)
    ob = make_optimizer(b, opt_name)
    train_steps(b, rank, n, ob)
    sg.save_full_state_dict(b, path)
    osd = sg.full_optim_state_dict(b, ob)  # rank 0 only: loading broadcasts it
    loss_at_save = _eval_loss(b, rank, n)
    del b, ob

    c, _ = _build(resume_kind, world, seed=1)
    oc = make_optimizer(c, opt_name)
    sg.load_full_state_dict(c, path)
    sg.load_full_optim_state_dict(c, oc, osd)
    loss_at_resume = _eval_loss(c, rank, n)
    # Buffers (BatchNorm statistics) are per rank and a full state dict holds rank 0's,
    # so only rank 0 resumes with exactly its own buffers.
    if exact and rank == 0 and loss_at_resume != loss_at_save:
        problems.append(f"loss after resume {loss_at_resume} != at save {loss_at_save}")
    train_steps(c, rank, m, oc, start=n)
    c_sd = sg.full_state_dict(c)
    c_osd = sg.full_optim_state_dict(c, oc)
    if rank == 0:
        if exact:
            problems += ["model: " + p for p in diff_state_dicts(c_sd, a_sd)]
        else:
            for k, v in a_sd.items():
                if not torch.allclose(c_sd[k].double(), v.double(), atol=1e-5, rtol=1e-4):
                    problems.append(f"model {k} not close")
        problems += ["optim: " + p for p in _same_osd(c_osd, a_osd, exact)]
    return {"problems": problems}


def _eval_loss(model: nn.Module, rank: int, step: int) -> float:
    """The loss on the next batch, in eval mode (so BatchNorm statistics stay put)."""
    from .models import batch

    model.eval()
    with torch.no_grad():
        loss = float(model(batch(rank, step)).float().pow(2).mean())
    model.train()
    return loss


def optim_edge_cases(rank: int, world: int) -> dict:  # type: ignore[type-arg]
    """Before the first step: an empty state that loads; a mismatched checkpoint fails."""
    model, _ = _build("fsdp2", world, seed=0)
    opt = make_optimizer(model, "adamw")
    osd = sg.full_optim_state_dict(model, opt, rank0_only=False)
    out: dict = {"empty_state": osd["state"] == {}, "groups": len(osd["param_groups"])}
    sg.load_full_optim_state_dict(model, opt, osd)
    bad = {
        "state": {},
        "param_groups": [dict(osd["param_groups"][0], params=["nope"]), osd["param_groups"][1]],
    }
    try:
        sg.load_full_optim_state_dict(model, opt, bad)
        out["mismatch"] = None
    except sg.StateDictMismatchError as exc:
        out["mismatch"] = str(exc)
    return out


def ckpt_save(rank: int, world: int, path: str, kind: str) -> dict:  # type: ignore[type-arg]
    """Train, save_checkpoint; return (rank 0) what was saved, for the loading side."""
    model, _ = _build(kind, world, seed=0)
    opt = make_optimizer(model, "adamw")
    train_steps(model, rank, 2, opt)
    sg.save_checkpoint(path, model, opt, extra={"step": 2, "note": "hi"})
    sd = sg.full_state_dict(model)
    osd = sg.full_optim_state_dict(model, opt)
    return {"sd": sd, "osd": osd}


def ckpt_load(rank: int, world: int, path: str, kind: str, saved_path: str) -> dict:  # type: ignore[type-arg]
    """A fresh model at another world size/flavour loads the checkpoint and trains on."""
    saved = torch.load(saved_path, weights_only=False)
    model, _ = _build(kind, world, seed=1)
    opt = make_optimizer(model, "adamw")
    extra = sg.load_checkpoint(path, model, opt)
    sd = sg.full_state_dict(model)
    osd = sg.full_optim_state_dict(model, opt)
    problems: list[str] = []
    if rank == 0:
        problems += ["model: " + p for p in diff_state_dicts(sd, saved["sd"], order=False)]
        problems += ["optim: " + p for p in _same_osd(osd, saved["osd"], exact=True)]
        if extra != {"step": 2, "note": "hi"}:
            problems.append(f"extra {extra}")
    train_steps(model, rank, 1, opt, start=2)
    return {"problems": problems}


def load_sources(rank: int, world: int, path: str, load_kind: str = "fsdp2") -> dict:  # type: ignore[type-arg]
    """load_full_state_dict from a torch file (mmap), a dict on every rank, and a dict on
    rank 0 only; each into a fresh FSDP model, bit-exact."""
    saved, _ = _build("fsdp1", world, seed=0)
    train_steps(saved, rank, 1, torch.optim.SGD(saved.parameters(), lr=0.1))
    want = sg.full_state_dict(saved, rank0_only=False, transport="collective")
    if rank == 0:
        # As DDP users save it: wrapped names, which loading cleans.
        torch.save({"state_dict": {"module." + k: v for k, v in want.items()}}, path)
    dist.barrier()
    problems: list[str] = []
    received = [0]
    real_irecv = dist.irecv

    def counting_irecv(tensor, *a, **k):  # type: ignore[no-untyped-def]
        received[0] += tensor.numel() * tensor.element_size()
        return real_irecv(tensor, *a, **k)

    for name, source in {
        "torch file": path,
        "dict on every rank": want,
        "dict on rank 0 only": want if rank == 0 else {},
    }.items():
        model, _ = _build(load_kind, world, seed=1)
        dist.irecv = counting_irecv
        try:
            res = sg.load_full_state_dict(model, source)
        finally:
            dist.irecv = real_irecv
        if name == "dict on rank 0 only" and rank != 0:
            # Only this rank's elements travel to it, not every tensor.
            total = sum(
                v.numel() * v.element_size() for k, v in want.items() if k != "lm_head.weight"
            )
            if not 0 < received[0] < 0.6 * total:
                problems.append(f"rank {rank} received {received[0]} of {total} bytes")
        got = sg.full_state_dict(model)
        if rank == 0:
            problems += [f"{name}: " + p for p in diff_state_dicts(got, want, order=False)]
            if res.missing_keys or res.unexpected_keys:
                problems.append(f"{name}: {res}")
    return {"problems": problems}


MIXED_HOST_CASES = {
    # id: (model kind, host of each rank): SHARDGATHER_HOST_ID pretends the ranks run on
    # several hosts; ranks off rank 0's host must send their pieces to rank 0.
    "fsdp1-2+2": ("fsdp1", "aabb"),
    "fsdp1_orig-rank0_alone-world3": ("fsdp1-orig", "abb"),
    "fsdp2-interleaved": ("fsdp2", "abab"),
    # HSDP across hosts: rank 0's replica is all on host a, so nothing travels.
    "hsdp-replica_per_host": ("fsdp2-hsdp", "aabb"),
    "hsdp-shards_across_hosts": ("fsdp2-hsdp", "abab"),
}


def mixed_hosts(rank: int, world: int, path: str, case: str) -> dict:  # type: ignore[type-arg]
    """The node-local transport with ranks on several (pretend) hosts gives exactly the
    collective path's results: gather (same dtype, bf16 cast, tiny messages), save,
    optimizer state; and moves only the remote ranks' pieces."""
    import os

    from shardgather import _forward, _node_local

    kind, hosts = MIXED_HOST_CASES[case]
    os.environ["SHARDGATHER_HOST_ID"] = "host-" + hosts[rank]
    _node_local._HOSTS.clear()
    model, plain = _build(kind, world, seed=0)
    opt = make_optimizer(model, "adamw")
    problems = _check(rank, sg.full_state_dict(model), plain.state_dict(), True)
    train_steps(model, rank, 2, opt)

    want = sg.full_state_dict(model, transport="collective")
    before = dict(_forward.STATS)
    got = sg.full_state_dict(model)
    moved = {k: _forward.STATS[k] - before[k] for k in before}
    got_bf16 = sg.full_state_dict(model, dtype=torch.bfloat16)
    got_small = sg.full_state_dict(model, bucket_mb=0.001)
    sg.save_full_state_dict(model, path)
    before_shared = dict(_forward.STATS)
    sg.save_full_state_dict(model, path + ".shared", shared_filesystem=True)
    moved_shared = sum(_forward.STATS[k] - before_shared[k] for k in before_shared)
    want_osd = sg.full_optim_state_dict(model, opt, transport="collective")
    got_osd = sg.full_optim_state_dict(model, opt)
    if rank == 0:
        problems += diff_state_dicts(got, want)
        problems += ["bf16: " + p for p in diff_state_dicts(got_bf16, _expected_cast(want))]
        problems += ["tiny messages: " + p for p in diff_state_dicts(got_small, want)]
        problems += ["file: " + p for p in diff_state_dicts(sg.load_file(path), want, order=False)]
        shared = sg.load_file(path + ".shared")
        problems += ["shared fs file: " + p for p in diff_state_dicts(shared, want, order=False)]
        problems += ["optim: " + p for p in _same_osd(got_osd, want_osd, exact=True)]
    if moved_shared:
        problems.append(f"shared_filesystem=True still forwarded {moved_shared} bytes")
    return {"problems": problems, "moved": moved, "remote": hosts[rank] != hosts[0]}


def _expected_cast(sd: dict) -> dict:  # type: ignore[type-arg]
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()}


def mixed_hosts_sender_fails(rank: int, world: int, path: str, op: str) -> dict:  # type: ignore[type-arg]
    """A rank on another host fails while packing its pieces: every rank raises
    CollectiveError (nobody hangs), and nothing is left in /dev/shm or as a file."""
    import datetime
    import os

    from shardgather import _forward, _node_local

    os.environ["SHARDGATHER_HOST_ID"] = "host-" + "ab"[rank]
    _node_local._HOSTS.clear()
    model, _ = _build("fsdp2", world, seed=0)
    before = set(os.listdir("/dev/shm"))
    if rank == 1:

        def broken(*a, **k):  # type: ignore[no-untyped-def]
            raise RuntimeError("simulated failure while packing")

        _forward.cast_into = broken
    raised, message = None, ""
    timeout = datetime.timedelta(seconds=60)
    try:
        if op == "gather":
            sg.full_state_dict(model, dtype=torch.bfloat16, timeout=timeout)
        else:
            sg.save_full_state_dict(model, path, dtype=torch.bfloat16, timeout=timeout)
    except sg.ShardGatherError as exc:
        raised, message = type(exc).__name__, str(exc)
    leaked = [n for n in set(os.listdir("/dev/shm")) - before if n.startswith("shardgather")]
    files = [n for n in os.listdir(os.path.dirname(path)) if os.path.basename(path) in n]
    return {"raised": raised, "message": message, "leaked": leaked, "files": files}


def _io_read_bytes() -> int:
    """Bytes this process read through read()/pread() (sockets included)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def load_reads_only_own_bytes(rank: int, world: int, path: str, kind: str) -> dict:  # type: ignore[type-arg]
    """Loading a safetensors file, a rank reads its own elements' bytes (plus the
    header and the tensors every rank holds in full), not the file."""
    from shardgather import _pieces
    from shardgather._plan import build_plan
    from shardgather.testing import Block as GPTBlock
    from shardgather.testing import build_gpt

    model = build_gpt(0.1)
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FSDP(
            model, auto_wrap_policy=ModuleWrapPolicy({GPTBlock}), device_id=torch.device("cpu")
        )
    else:
        from torch.distributed.fsdp import fully_shard

        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
    sg.save_full_state_dict(model, path)
    plan = build_plan(model)
    own = sum(e.nbytes for e in plan.entries.values() if e.source.group is None)
    own += sum(pc.numel * pc.entry.dtype.itemsize for pc in _pieces.pieces_of(plan, lambda i: True))
    before = _io_read_bytes()
    sg.load_full_state_dict(model, path)
    read = _io_read_bytes() - before
    import os

    return {"read": read, "own": own, "file": os.path.getsize(path)}
