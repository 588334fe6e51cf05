"""full_state_dict on real FSDP1/FSDP2 models in 2-4 gloo processes, bit-exact
against the plain model (before training) and torch's own full state dict (after)."""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch
from torch import nn

import shardgather as sg

from . import dist_harness
from .builders import (
    apply_ac,
    build,
    check,
    expected,
    expected_cast,
    recv_reference,
    same_osd,
    serializable,
    strategy,
)
from .compare import diff_state_dicts
from .models import Block, ConvNet, TinyLM, make_optimizer, train_steps

pytestmark = pytest.mark.distributed


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


def _before_training(rank: int, model: nn.Module, plain: nn.Module, kw: dict):  # type: ignore[no-untyped-def,type-arg]
    """The case's options, and a gather checked against the plain model (the oracle
    before any step) and against what users do next with the dict (save it)."""
    opts = {
        "rank0_only": kw.get("rank0_only", True),
        "bucket_mb": kw.get("bucket_mb"),
        "dtype": kw.get("dtype"),
        "transport": kw.get("transport", "auto"),
    }
    got = sg.full_state_dict(model, **opts)
    problems = [
        "before training: " + p
        for p in check(rank, got, expected(plain, opts["dtype"]), opts["rank0_only"])
    ]
    return opts, got, problems + serializable(got)


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
        apply_ac(model)
    plain = copy.deepcopy(model)
    fsdp_kwargs: dict = {
        "device_id": torch.device("cpu"),
        "use_orig_params": kw.get("use_orig_params", False),
        "sharding_strategy": strategy(kw.get("strategy", "FULL_SHARD")),
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
        apply_ac(wrapped)
    if kw.get("compile"):
        wrapped = torch.compile(wrapped)
    # 1. Right after wrapping (lazy init not run): the plain model is the oracle.
    opts, got, problems = _before_training(rank, wrapped, plain, kw)

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


def fsdp1_channels_last(rank: int, world: int) -> dict:  # type: ignore[type-arg]
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = ConvNet()
    plain = copy.deepcopy(model)
    wrapped = FSDP(model, device_id=torch.device("cpu"))
    got = sg.full_state_dict(wrapped)
    return {"problems": check(rank, got, plain.state_dict(), True)}


def fsdp2_case(rank: int, world: int, case: str) -> dict:  # type: ignore[type-arg]
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    _, kw = FSDP2_CASES[case]
    torch.manual_seed(0)
    model = TinyLM(tied=kw.get("tied", True), frozen_bf16=kw.get("frozen_bf16", False))
    if kw.get("ac") == "inside":
        apply_ac(model)
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
    opts, got, problems = _before_training(rank, model, plain, kw)
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
        rank0 = {k: v for k, v in recv_reference(got, rank).items() if k in params}
        problems += [
            f"rank {rank}: " + p
            for p in diff_state_dicts({k: v for k, v in got.items() if k in params}, rank0)
        ]
    train_steps(model, rank, 1, opt)
    return {"problems": problems, "keys": len(got)}


def ddp_case(rank: int, world: int) -> dict:  # type: ignore[type-arg]
    torch.manual_seed(0)
    model = TinyLM()
    plain = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    got = sg.full_state_dict(ddp)
    return {"problems": check(rank, got, plain.state_dict(), True)}


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

    from shardgather._engine import run

    torch.manual_seed(0)
    model = FSDP(TinyLM(), device_id=torch.device("cpu"))
    if rank == 1:
        orig = run.gather_buckets

        @functools.wraps(orig)
        def dying(*a, **k):  # type: ignore[no-untyped-def]
            torch.save({"raised": "died"}, os.environ.get("SG_DUMMY", "/dev/null"))
            os._exit(3)
            yield  # pragma: no cover

        run.gather_buckets = dying
    try:
        sg.full_state_dict(model, timeout=datetime.timedelta(seconds=20), transport="collective")
    except sg.CollectiveError as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None}


def node_local_rank_dies(rank: int, world: int) -> dict:  # type: ignore[type-arg]
    """Rank 1 dies while writing its pieces: rank 0 raises; /dev/shm keeps nothing."""
    import datetime
    import os

    from shardgather._engine import run

    model, _ = build("fsdp1", world, seed=0)
    before = set(os.listdir("/dev/shm"))
    if rank == 1:

        def die(*a, **k):  # type: ignore[no-untyped-def]
            os._exit(3)

        run.write_pieces = die
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

    from shardgather._engine import node_local, remote

    model, plain = build("fsdp2", world, seed=0)
    node_local.shm_free_bytes = lambda: 0
    if not memfd:
        node_local.memfd_shareable = lambda call, hosts: False  # e.g. ranks in other pid namespaces

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = sg.full_state_dict(model, transport="node-local")
    msgs = [str(w.message) for w in caught if "node-local" in str(w.message)]
    if remote.STATS["sent"] or remote.STATS["received"]:
        msgs.append(f"one host, yet pieces travelled point to point: {remote.STATS}")
    problems = check(rank, got, plain.state_dict(), True)
    # Node-local outputs are views of a mapped region; the collective path's are not.
    node_local = rank == 0 and got["embed.weight"].untyped_storage().filename is not None
    return {"warnings": msgs if rank == 0 else [], "problems": problems, "node_local": node_local}


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

    from shardgather._engine import remote

    kind, hosts = MIXED_HOST_CASES[case]
    os.environ["SHARDGATHER_HOST_ID"] = "host-" + hosts[rank]
    model, plain = build(kind, world, seed=0)
    opt = make_optimizer(model, "adamw")
    problems = check(rank, sg.full_state_dict(model), plain.state_dict(), True)
    train_steps(model, rank, 2, opt)

    want = sg.full_state_dict(model, transport="collective")
    before = dict(remote.STATS)
    got = sg.full_state_dict(model)
    moved = {k: remote.STATS[k] - before[k] for k in before}
    got_bf16 = sg.full_state_dict(model, dtype=torch.bfloat16)
    got_small = sg.full_state_dict(model, bucket_mb=0.001)
    sg.save_full_state_dict(model, path)
    before_shared = dict(remote.STATS)
    sg.save_full_state_dict(model, path + ".shared", shared_filesystem=True)
    moved_shared = sum(remote.STATS[k] - before_shared[k] for k in before_shared)
    want_osd = sg.full_optim_state_dict(model, opt, transport="collective")
    got_osd = sg.full_optim_state_dict(model, opt)
    if rank == 0:
        problems += diff_state_dicts(got, want)
        problems += ["bf16: " + p for p in diff_state_dicts(got_bf16, expected_cast(want))]
        problems += ["tiny messages: " + p for p in diff_state_dicts(got_small, want)]
        problems += ["file: " + p for p in diff_state_dicts(sg.load_file(path), want, order=False)]
        shared = sg.load_file(path + ".shared")
        problems += ["shared fs file: " + p for p in diff_state_dicts(shared, want, order=False)]
        problems += ["optim: " + p for p in same_osd(got_osd, want_osd, exact=True)]
    if moved_shared:
        problems.append(f"shared_filesystem=True still forwarded {moved_shared} bytes")
    return {"problems": problems, "moved": moved, "remote": hosts[rank] != hosts[0]}


def mixed_hosts_sender_fails(rank: int, world: int, path: str, op: str) -> dict:  # type: ignore[type-arg]
    """A rank on another host fails while packing its pieces: every rank raises
    CollectiveError (nobody hangs), and nothing is left in /dev/shm or as a file."""
    import datetime
    import os

    from shardgather._engine import remote

    os.environ["SHARDGATHER_HOST_ID"] = "host-" + "ab"[rank]
    model, _ = build("fsdp2", world, seed=0)
    before = set(os.listdir("/dev/shm"))
    if rank == 1:

        def broken(*a, **k):  # type: ignore[no-untyped-def]
            raise RuntimeError("simulated failure while packing")

        remote.pack_into = broken
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


@pytest.mark.parametrize("case", list(FSDP1_CASES))
def test_fsdp1(case: str) -> None:
    world, _ = FSDP1_CASES[case]
    results = dist_harness.run("tests.test_full_state_dict:fsdp1_case", world, case=case)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert results[0]["keys"] > 0


@pytest.mark.parametrize("case", list(FSDP2_CASES))
def test_fsdp2(case: str) -> None:
    world, _ = FSDP2_CASES[case]
    results = dist_harness.run("tests.test_full_state_dict:fsdp2_case", world, case=case)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)


def test_fsdp1_channels_last_conv_keeps_plain_stride() -> None:
    results = dist_harness.run("tests.test_full_state_dict:fsdp1_channels_last", 2)
    assert not results[0]["problems"], results[0]["problems"]


def test_ddp_wrapped() -> None:
    results = dist_harness.run("tests.test_full_state_dict:ddp_case", 2)
    assert not results[0]["problems"], results[0]["problems"]


def test_mismatched_models_raise_on_every_rank() -> None:
    results = dist_harness.run("tests.test_full_state_dict:mismatched_models", 2)
    for r in results:
        assert r["raised"] == "CollectiveError", r
        assert "same" in r["message"]


def test_rank_dying_mid_gather_raises_instead_of_hanging() -> None:
    results = dist_harness.run(
        "tests.test_full_state_dict:rank_fails_midway", 2, timeout=120, _allow_missing=(1,)
    )
    assert results[0]["raised"] == "CollectiveError", results[0]


def test_plain_module_without_process_group() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    got = sg.full_state_dict(model)
    assert not diff_state_dicts(got, model.state_dict())
    assert got["lm_head.weight"] is got["embed.weight"]
    # Copies, not references: the caller may mutate them.
    assert got["embed.weight"].data_ptr() != model.embed.weight.data_ptr()


def test_a_module_renaming_itself_in_a_state_dict_hook_is_warned_once() -> None:
    """shardgather does not run a module's own state_dict hooks (torchtitan's fused QKV
    splits itself in one): the keys would differ from state_dict() without a word."""
    import warnings

    torch.manual_seed(0)
    model = TinyLM()

    def rename(module, sd, prefix, local_metadata):  # type: ignore[no-untyped-def]
        sd[prefix + "w"] = sd.pop(prefix + "weight")

    model.blocks[0].fc1.register_state_dict_post_hook(rename)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sg.full_state_dict(model)
        sg.full_state_dict(model)
    said = [str(w.message) for w in caught if "state_dict hooks" in str(w.message)]
    assert len(said) == 1 and "'blocks.0.fc1'" in said[0] and "key_map=" in said[0]


def test_compiled_plain_module_has_clean_keys() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    got = sg.full_state_dict(torch.compile(model))
    assert list(got) == list(model.state_dict())


def test_not_a_module_is_a_clear_error() -> None:
    with pytest.raises(sg.ShardGatherError, match=r"nn\.Module"):
        sg.full_state_dict({"a": torch.zeros(1)})  # type: ignore[arg-type]


def test_node_local_rank_dying_leaves_no_shared_memory() -> None:
    results = dist_harness.run(
        "tests.test_full_state_dict:node_local_rank_dies", 2, timeout=120, _allow_missing=(1,)
    )
    assert results[0]["raised"] is not None, results[0]
    assert results[0]["leaked"] == []


def test_shm_too_small_falls_back_with_one_warning() -> None:
    results = dist_harness.run("tests.test_full_state_dict:shm_too_small", 2, memfd=False)
    assert not [p for r in results for p in r["problems"]]
    assert len(results[0]["warnings"]) == 1 and "free" in results[0]["warnings"][0]
    assert not results[0]["node_local"]


def test_full_dev_shm_does_not_matter_with_a_memfd() -> None:
    # Docker caps /dev/shm at 64 MiB by default; rank 0's memfd is not in /dev/shm.
    results = dist_harness.run("tests.test_full_state_dict:shm_too_small", 2, memfd=True)
    assert not [p for r in results for p in r["problems"]]
    assert results[0]["warnings"] == [] and results[0]["node_local"]


@pytest.mark.parametrize("case", list(MIXED_HOST_CASES))
def test_ranks_on_other_hosts_send_their_pieces(case: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, hosts = MIXED_HOST_CASES[case]
    results = dist_harness.run(
        "tests.test_full_state_dict:mixed_hosts",
        len(hosts),
        path=str(tmp_path / "m.safetensors"),
        case=case,
    )
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    sent = [r["moved"]["sent"] for r in results]
    received = results[0]["moved"]["received"]
    assert received == sum(sent)
    if case == "hsdp-replica_per_host":
        assert received == 0  # rank 0's replica lives on rank 0's host
    else:
        assert received > 0
        # Only remote ranks send (and only those in rank 0's replica).
        assert all(r["remote"] for s, r in zip(sent, results) if s > 0), sent


@pytest.mark.parametrize("op", ["gather", "save"])
def test_remote_rank_failing_raises_everywhere_and_leaves_nothing(op: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = dist_harness.run(
        "tests.test_full_state_dict:mixed_hosts_sender_fails",
        2,
        path=str(tmp_path / "m.safetensors"),
        op=op,
        timeout=180,
    )
    for r in results:
        assert r["raised"] == "CollectiveError", r
        assert "simulated failure while packing" in r["message"], r["message"]
        assert r["leaked"] == [], r
    # Rank 0 removes its temp file before it raises; the other ranks may look earlier.
    assert results[0]["files"] == [], results[0]
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "rename, fix",
    [
        (lambda k: "_fsdp_wrapped_module." + k, "key_map=sg.clean_fqn"),
        (lambda k: "module." + k, "key_map=sg.clean_fqn"),
        (lambda k: "model." + k, "key_map={'model.': ''}"),
    ],
    ids=["fsdp1-wrapped", "ddp", "hf-prefix"],
)
def test_a_key_mismatch_that_a_key_map_repairs_names_that_key_map(rename, fix, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The error gives the working fix, and the fix works."""
    model = TinyLM(tied=False)
    path = str(tmp_path / "m.safetensors")
    sg.save_full_state_dict(model, path, key_map={"": rename("")})
    with pytest.raises(sg.StateDictMismatchError) as e:
        sg.load_full_state_dict(model, path)
    assert fix in str(e.value), str(e.value)
    key_map = sg.clean_fqn if "clean_fqn" in fix else {"model.": ""}
    target = copy.deepcopy(model).apply(_zero)
    sg.load_full_state_dict(target, path, key_map=key_map)
    assert not diff_state_dicts(target.state_dict(), model.state_dict())


def _zero(m: nn.Module) -> None:
    with torch.no_grad():
        for p in m.parameters(recurse=False):
            p.zero_()


def test_a_model_prefix_mismatch_names_the_reverse_key_map(tmp_path) -> None:  # type: ignore[no-untyped-def]
    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = TinyLM(tied=False)

    path = str(tmp_path / "m.safetensors")
    inner = TinyLM(tied=False)
    sg.save_full_state_dict(inner, path)
    outer = Wrapped().apply(_zero)
    with pytest.raises(sg.StateDictMismatchError) as e:
        sg.load_full_state_dict(outer, path)
    assert "key_map={'': 'model.'}" in str(e.value), str(e.value)
    sg.load_full_state_dict(outer, path, key_map={"": "model."})
    assert not diff_state_dicts(outer.model.state_dict(), inner.state_dict())
