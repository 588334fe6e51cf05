"""LoRA adapters under FSDP (issue 28), with the real peft and transformers: a tiny Llama
with LoRA on attention and MLP, sharded by FSDP1 (``use_orig_params=True``, the frozen
base and the trainable adapter in one flat parameter per layer) and FSDP2, 2 ranks, CPU.

The oracle is PEFT's own ``get_peft_model_state_dict`` of the unsharded model holding the
trained values (torch's full state dict of the sharded one, loaded into a plain copy)."""

from __future__ import annotations

import contextlib
import copy
import json
import os

import pytest
import torch

import shardgather as sg
from shardgather import _dist
from shardgather._plan import build_plan

from . import dist_harness
from .compare import diff_state_dicts

pytest.importorskip("peft")
pytest.importorskip("transformers")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _llama(seed: int, **sizes: int):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    config = LlamaConfig(**{**tiny, **sizes})
    torch.manual_seed(seed)
    return LlamaForCausalLM(config), config


def _peft_llama(seed: int):  # type: ignore[no-untyped-def]
    from peft import LoraConfig, get_peft_model

    base, config = _llama(seed)
    lora = LoraConfig(r=2, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    return get_peft_model(base, lora), config


def _shard(model, kind: str):  # type: ignore[no-untyped-def]
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
            use_orig_params=True,  # frozen base + trainable adapter in one flat param
            device_id=torch.device("cpu"),
        )
    from torch.distributed.fsdp import fully_shard

    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _trainable(model):  # type: ignore[no-untyped-def]
    return [p for p in model.parameters() if p.requires_grad]


def _steps(model, opt, rank: int, start: int, stop: int) -> None:  # type: ignore[no-untyped-def]
    for step in range(start, stop):
        g = torch.Generator().manual_seed(1000 * step + rank)
        batch = torch.randint(0, 64, (2, 8), generator=g)
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()


def _train_step(model, rank: int) -> None:  # type: ignore[no-untyped-def]
    _steps(model, torch.optim.AdamW(_trainable(model), lr=1e-2), rank, 0, 1)


def adapter_worker(rank: int, world: int, kind: str, tmp: str) -> dict:  # type: ignore[type-arg]
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import LlamaForCausalLM

    out: dict = {"problems": []}
    bad = out["problems"]
    pm, config = _peft_llama(seed=0)
    plain = copy.deepcopy(pm)
    model = _shard(pm, kind)
    _train_step(model, rank)

    # The oracle: torch's own full state dict, in a plain copy, asked of PEFT.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    plain.load_state_dict(full)
    want = get_peft_model_state_dict(plain)
    names = sg.adapter_keys(model)
    if sorted(names.values()) != sorted(want):
        bad.append(f"adapter_keys {sorted(names.values())[:3]} vs PEFT {sorted(want)[:3]}")
    trainable = sg.full_state_dict(model, keys="trainable")
    if rank == 0 and sorted(trainable) != sorted(names):
        bad.append("keys='trainable' is not the adapter")
    # The weight stream of a LoRA policy: the adapter alone.
    streamed = dict(sg.iter_full_tensors(model, keys="trainable", owned=True))
    if rank == 0:
        got = {names[k]: v for k, v in streamed.items()}
        if sorted(got) != sorted(want):
            bad.append(f"stream keys {sorted(got)[:3]}...")
        ordered = {k: got[k] for k in want if k in got}  # the stream goes bucket by bucket
        bad += ["stream: " + p for p in diff_state_dicts(ordered, want)]

    # Adapter-only export, by every transport, bit-exact for every rank's slice.
    for transport in ("auto", "collective"):
        d = os.path.join(tmp, f"{kind}-{transport}")
        before = dict(_dist.STATS)
        sg.save_adapter(model, d, transport=transport)
        moved = _dist.STATS["bytes_received"] - before["bytes_received"]
        if rank == 0:
            got = load_file(os.path.join(d, "adapter_model.safetensors"))
            bad += [f"{transport}: {p}" for p in diff_state_dicts(got, want)]
            out[f"received_{transport}"] = moved
    if rank == 0:
        out["adapter_bytes"] = sum(t.numel() * t.element_size() for t in want.values())
        out["model_bytes"] = sum(t.numel() * t.element_size() for t in full.values())
        if kind == "fsdp2":
            # What the ecosystem's bug wrote (each rank's local slice): this test catches it.
            naive = {
                names[k]: p.to_local().detach()
                for k, p in zip(names, [model.get_parameter(k) for k in names])
            }
            out["naive_caught"] = bool(diff_state_dicts(naive, want))
        # PEFT itself loads the export into the plain architecture.
        torch.manual_seed(7)
        loaded = PeftModel.from_pretrained(
            LlamaForCausalLM(config), os.path.join(tmp, f"{kind}-auto")
        )
        bad += [
            "from_pretrained: " + p
            for p in diff_state_dicts(get_peft_model_state_dict(loaded), want)
        ]

    # The merged model (PEFT's merge_and_unload), each rank merging its own elements:
    # as a dict, as a from_pretrained-able directory, as a stream; the factors fetched
    # all at once (this adapter is far below the budget), and a layer at a time with the
    # deltas added a row at a time (a large adapter's phases, on this small model).
    merged_want = copy.deepcopy(plain).merge_and_unload().state_dict()
    for phased in (False, True):
        with _merge_in_phases(phased):
            bad += _merged_exports(model, config, rank, tmp, f"{kind}-{phased}", merged_want)
            plan = sg.adapters.merging(model, "default")(build_plan(model))
            out[f"phases_{phased}"] = len(plan.phases or ())
    # Ranks on two hosts (pretended): rank 1 sends its merged pieces to rank 0 phase by
    # phase, between the phases' factor gathers on the same group.

    os.environ["SHARDGATHER_HOST_ID"] = "host-" + "ab"[rank]
    try:
        with _merge_in_phases(True):
            before = _dist.STATS["bytes_received"]
            two_hosts = sg.full_state_dict(model, merge_adapter="default")
            out["two_hosts_received"] = _dist.STATS["bytes_received"] - before
            one_file = os.path.join(tmp, f"{kind}-two-hosts.safetensors")
            sg.save_full_state_dict(model, one_file, merge_adapter="default")
    finally:
        del os.environ["SHARDGATHER_HOST_ID"]
    if rank == 0:
        bad += ["two hosts: " + p for p in diff_state_dicts(two_hosts, merged_want)]
        bad += [
            "two hosts, file: " + p for p in diff_state_dicts(sg.load_file(one_file), merged_want)
        ]

    # Load the adapter into a differently initialised sharded model: the adapter's
    # elements change (each rank reading its own), the base does not.
    fresh_pm, _ = _peft_llama(seed=3)
    fresh = _shard(fresh_pm, kind)
    base_before = sg.full_state_dict(fresh, keys=lambda k: k not in names)
    result = sg.load_adapter(fresh, os.path.join(tmp, f"{kind}-auto"))
    out["load_result"] = [list(result.missing_keys), list(result.unexpected_keys)]
    after = sg.full_state_dict(fresh)
    if rank == 0:
        got_adapter = {names[k]: after[k] for k in names}
        bad += ["load_adapter: " + p for p in diff_state_dicts(got_adapter, want)]
        base_after = {k: v for k, v in after.items() if k not in names}
        bad += ["base changed: " + p for p in diff_state_dicts(base_after, base_before)]
    # Exact resume of a LoRA run from an adapter-only checkpoint (keys="trainable"):
    # the adapter and its optimizer state, the base reloaded as it came.
    run = _shard(_peft_llama(seed=0)[0], kind)
    opt = torch.optim.AdamW(_trainable(run), lr=1e-2)
    _steps(run, opt, rank, 0, 2)
    ckpt = os.path.join(tmp, f"{kind}-ckpt")
    sg.save_checkpoint(ckpt, run, opt, keys="trainable", extra={"step": 2})
    _steps(run, opt, rank, 2, 4)
    final = sg.full_state_dict(run)
    restart, _ = _peft_llama(seed=0)
    with torch.no_grad():
        for p in _trainable(restart):  # a different adapter: the checkpoint must restore it
            p.normal_(generator=torch.Generator().manual_seed(5))
    restart = _shard(restart, kind)
    opt = torch.optim.AdamW(_trainable(restart), lr=1e-2)
    extra = sg.load_checkpoint(ckpt, restart, opt)
    _steps(restart, opt, rank, extra["step"], 4)
    resumed = sg.full_state_dict(restart)
    if rank == 0:
        bad += ["resumed: " + p for p in diff_state_dicts(resumed, final)]
        stored = sorted(load_file(os.path.join(ckpt, "model.safetensors")))
        if stored != sorted(names):
            bad.append(f"the adapter checkpoint stores {len(stored)} tensors, not the adapter")

    # A file missing a tensor is refused before anything changes.
    partial = os.path.join(tmp, f"{kind}-partial.safetensors")
    if rank == 0:
        from safetensors.torch import save_file

        save_file(dict(list(want.items())[1:]), partial)
    torch.distributed.barrier()
    try:
        sg.load_adapter(fresh, partial)
        bad.append("a partial adapter file loaded")
    except sg.StateDictMismatchError as exc:
        out["partial_error"] = str(exc)
    return out


@contextlib.contextmanager
def _merge_in_phases(phased: bool):  # type: ignore[no-untyped-def]
    """Phased: the factors of one source at a time, its deltas a row at a time (a
    1-byte factor budget, 64 delta elements: the phases a large adapter moves in)."""
    from shardgather import adapters
    from shardgather._plan import merge

    saved = adapters.FACTOR_BYTES, merge.DELTA_ELEMENTS
    if phased:
        adapters.FACTOR_BYTES, merge.DELTA_ELEMENTS = 1, 64
    try:
        yield
    finally:
        adapters.FACTOR_BYTES, merge.DELTA_ELEMENTS = saved


def _merged_exports(model, config, rank: int, tmp: str, name: str, want: dict) -> list[str]:  # type: ignore[no-untyped-def,type-arg]
    """The merged model by every route, each compared with ``want`` on rank 0."""
    from transformers import LlamaForCausalLM

    bad: list[str] = []
    merged = sg.full_state_dict(model, merge_adapter="default")
    gathered = sg.full_state_dict(model, merge_adapter="default", transport="collective")
    merged_dir = os.path.join(tmp, f"{name}-merged")
    sg.save_full_state_dict(
        model, merged_dir + "/", merge_adapter="default", files={"config.json": config.to_dict()}
    )
    one_file = os.path.join(tmp, f"{name}-merged.safetensors")
    sg.save_full_state_dict(model, one_file, merge_adapter="default", transport="collective")
    stream = dict(sg.iter_full_tensors(model, merge_adapter="default", owned=True))
    if rank == 0:
        bad += [f"{name} merged: " + p for p in diff_state_dicts(merged, want)]
        bad += [f"{name} merged, collective: " + p for p in diff_state_dicts(gathered, want)]
        hf = LlamaForCausalLM.from_pretrained(merged_dir)
        bad += [f"{name} from_pretrained: " + p for p in diff_state_dicts(hf.state_dict(), want)]
        from_file = sg.load_file(one_file)
        bad += [f"{name} file, collective: " + p for p in diff_state_dicts(from_file, want)]
        ordered = {k: stream[k] for k in want if k in stream}
        bad += [f"{name} merged stream: " + p for p in diff_state_dicts(ordered, want)]
    return bad


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["fsdp1", "fsdp2"])
def test_adapter_export_and_load_bit_exact(kind: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    res = dist_harness.run(
        "tests.test_adapters:adapter_worker", 2, kind=kind, tmp=str(tmp_path), timeout=300
    )
    for r in res:
        assert r["problems"] == []
        # One phase; then at least one per source holding LoRA weights (FSDP1: a flat
        # parameter per layer, 2; FSDP2: a source per weight, 14).
        assert r["phases_False"] == 1
        assert r["phases_True"] >= (2 if kind == "fsdp1" else 14)
        assert r["load_result"] == [[], []]
        assert "missing keys" in r["partial_error"] and "Nothing was loaded" in r["partial_error"]
    r0 = res[0]
    # On two hosts rank 0 receives rank 1's merged pieces (and both the factors).
    assert r0["two_hosts_received"] > res[1]["two_hosts_received"] > 0
    # Only the adapter's bytes move: by point-to-point messages (the collective
    # transport) rank 0 receives the other rank's half of the adapter (plus the 16-byte
    # alignment of each chunk), never the frozen base that shares its flat parameters.
    assert r0["adapter_bytes"] * 10 < r0["model_bytes"]  # a real adapter: a small part
    assert 0 < r0["received_collective"] <= r0["adapter_bytes"] + 16 * 64
    assert r0["received_auto"] == 0  # one host: rank 1 writes its own pieces
    if kind == "fsdp2":
        assert r0["naive_caught"]


def _config(method: str):  # type: ignore[no-untyped-def]
    from peft import IA3Config, LoraConfig, PromptTuningConfig

    if method == "ia3":
        return IA3Config(
            target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]
        )
    if method == "prompt":
        return PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    extra = {
        "lora": {},
        "rslora": {"use_rslora": True},
        "dora": {"use_dora": True},
        "modules_to_save": {"modules_to_save": ["lm_head"]},
    }[method]
    return LoraConfig(r=2, target_modules=TARGETS, init_lora_weights=False, **extra)


@pytest.mark.parametrize("method", ["lora", "rslora", "dora", "ia3", "modules_to_save"])
def test_adapter_keys_match_peft_on_a_plain_model(method: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """PEFT's own selection and names, for each method whose weights are parameters."""
    from peft import PeftModel, get_peft_model, get_peft_model_state_dict
    from transformers import LlamaForCausalLM

    base, config = _llama(seed=0)
    pm = get_peft_model(base, _config(method))
    names = sg.adapter_keys(pm)
    want = get_peft_model_state_dict(pm)
    assert sorted(names.values()) == sorted(want)
    got = sg.full_state_dict(pm, keys=list(names))
    assert diff_state_dicts({names[k]: got[k] for k in names}, want) == []
    sg.save_adapter(pm, tmp_path / "a")
    torch.manual_seed(9)
    loaded = PeftModel.from_pretrained(LlamaForCausalLM(config), tmp_path / "a")
    assert diff_state_dicts(get_peft_model_state_dict(loaded), want) == []


def test_an_adapter_without_task_type_loads_with_auto_peft_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Regression: with the README's LoraConfig(r=8, target_modules=[...]) (no
    task_type), AutoPeftModel.from_pretrained on save_adapter's directory failed ("Cannot
    infer the auto class from the config"): adapter_config.json lacked the auto_mapping
    PEFT's own save_pretrained writes."""
    from peft import AutoPeftModel, LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import LlamaForCausalLM

    base, _ = _llama(seed=0)
    base.save_pretrained(tmp_path / "base")
    base = LlamaForCausalLM.from_pretrained(tmp_path / "base")  # name_or_path: that directory
    pm = get_peft_model(base, LoraConfig(r=2, target_modules=TARGETS, init_lora_weights=False))
    sg.save_adapter(pm, tmp_path / "a")
    with open(tmp_path / "a" / "adapter_config.json") as f:
        written = json.load(f)
    assert written["auto_mapping"] == {
        "base_model_class": "LlamaForCausalLM",
        "parent_library": "transformers.models.llama.modeling_llama",
    }, written
    loaded = AutoPeftModel.from_pretrained(tmp_path / "a")
    want = get_peft_model_state_dict(pm)
    assert diff_state_dicts(get_peft_model_state_dict(loaded), want) == []


def config_fails_worker(rank: int, world: int, tmp: str) -> dict:  # type: ignore[type-arg]
    """save_adapter where rank 0 cannot write adapter_config.json; FSDP2 ranks, whose
    base-model class is fully_shard's ``FSDP<Name>`` subclass."""
    from shardgather import adapters

    pm, _ = _peft_llama(seed=0)
    pm = _shard(pm, "fsdp2")
    real = adapters._write_config
    out: dict = {}
    if rank == 0:

        def broken(*a, **k):  # type: ignore[no-untyped-def]
            raise sg.CheckpointError("adapter_config.json: disk full (simulated)")

        adapters._write_config = broken
    try:
        sg.save_adapter(pm, os.path.join(tmp, "a"))
        out["raised"] = None
    except sg.ShardGatherError as exc:
        out["raised"] = f"{type(exc).__name__}: {exc}"
    adapters._write_config = real
    sg.save_adapter(pm, os.path.join(tmp, "b"))  # the next call works
    with open(os.path.join(tmp, "b", "adapter_config.json")) as f:
        out["auto_mapping"] = json.load(f).get("auto_mapping")
    return out


def test_a_failed_adapter_config_write_raises_on_every_rank(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Regression: rank 0 wrote the config alone after the collective save; its failure
    raised on rank 0 only, the others returned as if the adapter were saved."""
    res = dist_harness.run("tests.test_adapters:config_fails_worker", 2, tmp=str(tmp_path))
    for r in res:
        assert r["raised"] and "disk full (simulated)" in r["raised"], r
        assert r["auto_mapping"]["base_model_class"] == "LlamaForCausalLM", r


def test_the_base_class_named_for_auto_peft_model_is_the_models_own_under_fsdp2() -> None:
    """fully_shard swaps a module's class for an ``FSDP<Name>`` subclass: the config
    names the class underneath."""
    from types import SimpleNamespace

    from torch.distributed.fsdp import FSDPModule
    from transformers import LlamaForCausalLM

    from shardgather.adapters import _base_model_class

    sharded = type("FSDPLlamaForCausalLM", (FSDPModule, LlamaForCausalLM), {})
    model = object.__new__(sharded)  # no __init__: only its class matters
    pm = SimpleNamespace(base_model=SimpleNamespace(model=model))
    assert _base_model_class(pm, prompt_learning=False) is LlamaForCausalLM
    wrapped = SimpleNamespace(_fsdp_wrapped_module=object.__new__(LlamaForCausalLM))
    pm = SimpleNamespace(base_model=SimpleNamespace(model=wrapped))  # FSDP1's wrapper
    assert _base_model_class(pm, prompt_learning=False) is LlamaForCausalLM


def test_adapter_errors_say_what_to_do() -> None:
    from peft import get_peft_model

    pm, _ = _peft_llama(seed=0)
    with pytest.raises(sg.ShardGatherError, match="no adapter 'other'"):
        sg.adapter_keys(pm, "other")
    with pytest.raises(sg.ShardGatherError, match="no PeftModel"):
        sg.adapter_keys(pm.base_model.model)
    prompt = get_peft_model(_llama(seed=0)[0], _config("prompt"))
    with pytest.raises(sg.ShardGatherError, match="prompt-learning"):
        sg.adapter_keys(prompt)


@pytest.mark.parametrize("rslora", [False, True])
def test_merged_export_matches_merge_and_unload(rslora: bool) -> None:
    """float32: bit-exact with PEFT (the same products, rows of B @ A being the rows of
    the product). bfloat16: shardgather merges in float32 and rounds once; PEFT rounds
    the delta to bf16 and adds in bf16 — apart by at most those roundings."""
    from peft import LoraConfig, get_peft_model

    base, _ = _llama(seed=0)
    config = LoraConfig(r=2, lora_alpha=8, use_rslora=rslora, target_modules=TARGETS)
    config.init_lora_weights = False
    pm = get_peft_model(base, config)
    want = copy.deepcopy(pm).merge_and_unload().state_dict()
    got = sg.full_state_dict(pm, merge_adapter="default")
    assert diff_state_dicts(got, want) == []
    low = copy.deepcopy(pm).to(torch.bfloat16)
    want16 = copy.deepcopy(low).merge_and_unload().state_dict()
    got16 = sg.full_state_dict(low, merge_adapter="default")
    assert list(got16) == list(want16)
    sd = low.state_dict()
    eps = torch.finfo(torch.bfloat16).eps
    for name, mod in low.named_modules():
        if not hasattr(mod, "lora_A") or "default" not in mod.lora_A:
            continue
        w = sd[f"{name}.base_layer.weight"].float()
        a, b = sd[f"{name}.lora_A.default.weight"], sd[f"{name}.lora_B.default.weight"]
        delta = (b.float() @ a.float()) * mod.scaling["default"]
        key = f"{name}.weight".removeprefix("base_model.model.")
        # what shardgather computes: the float32 merge, rounded once
        assert torch.equal(got16[key], (w + delta).to(torch.bfloat16)), key
        # PEFT rounds twice: apart by at most a rounding of each operand and the sum
        gap = (got16[key].float() - want16[key].float()).abs()
        assert (gap <= eps * (w.abs() + delta.abs() + want16[key].float().abs())).all(), key
    # dtype= casts after merging: the float32 merge, rounded once
    cast = sg.full_state_dict(pm, merge_adapter="default", dtype=torch.bfloat16)
    assert all(torch.equal(cast[k], want[k].to(torch.bfloat16)) for k in want)


@pytest.mark.parametrize(
    ("method", "match"),
    [("dora", "DoRA"), ("ia3", "IA3"), ("modules_to_save", "modules_to_save")],
)
def test_merges_it_does_not_cover_are_refused_by_name(method: str, match: str) -> None:
    from peft import get_peft_model

    pm = get_peft_model(_llama(seed=0)[0], _config(method))
    with pytest.raises(sg.UnsupportedModelError, match=match) as err:
        sg.full_state_dict(pm, merge_adapter="default")
    assert "save_adapter()" in str(err.value)
    with pytest.raises(sg.ShardGatherError, match="leave keys= out"):
        sg.full_state_dict(pm, merge_adapter="default", keys="trainable")


def tp_worker(rank: int, world: int, tmp: str) -> dict:  # type: ignore[type-arg]
    """LoRA on a model laid out 2-D: the base linears column/row-wise over tp, FSDP2 over
    dp on every block (the adapters sharded over dp only)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pm, _ = _peft_llama(seed=0)
    plain = copy.deepcopy(pm)
    plan = {
        **{f"self_attn.{p}.base_layer": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
        "self_attn.o_proj.base_layer": RowwiseParallel(),
        "mlp.gate_proj.base_layer": ColwiseParallel(),
        "mlp.up_proj.base_layer": ColwiseParallel(),
        "mlp.down_proj.base_layer": RowwiseParallel(),
    }
    layers = pm.base_model.model.model.layers
    for layer in layers:
        parallelize_module(layer, mesh["tp"], plan)
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(pm, mesh=mesh["dp"])
    placements = sorted(
        {str(p.placements) for n, p in pm.named_parameters() if "base_layer" in n and "proj" in n}
    )
    bad: list[str] = []
    sg.save_adapter(pm, os.path.join(tmp, "adapter"))
    merged = sg.full_state_dict(pm, merge_adapter="default")
    with _merge_in_phases(True):  # a layer's factors at a time, the deltas row by row
        phased = sg.full_state_dict(pm, merge_adapter="default")
        gathered = sg.full_state_dict(pm, merge_adapter="default", transport="collective")
    if rank == 0:
        want = get_peft_model_state_dict(plain)
        got = load_file(os.path.join(tmp, "adapter", "adapter_model.safetensors"))
        bad += ["adapter: " + p for p in diff_state_dicts(got, want)]
        merged_want = plain.merge_and_unload().state_dict()
        bad += ["merged: " + p for p in diff_state_dicts(merged, merged_want)]
        bad += ["merged in phases: " + p for p in diff_state_dicts(phased, merged_want)]
        bad += ["phases, collective: " + p for p in diff_state_dicts(gathered, merged_want)]
    return {"problems": bad, "placements": placements}


@pytest.mark.distributed
def test_adapters_of_a_tensor_parallel_base(tmp_path) -> None:  # type: ignore[no-untyped-def]
    res = dist_harness.run("tests.test_adapters:tp_worker", 4, tmp=str(tmp_path), timeout=300)
    assert "(_StridedShard(dim=0, sf=2), Shard(dim=0))" in res[0]["placements"]
    assert "(Shard(dim=0), Shard(dim=1))" in res[0]["placements"]
    for r in res:
        assert r["problems"] == []


def merged_memory_worker(rank: int, world: int, tmp: str) -> dict:  # type: ignore[type-arg]
    """Peak RSS rise of merged exports whose adapter (153 MiB of factors) is larger than
    the 1-D save bound (two 16 MiB buckets + 64 MiB), FSDP2 on 2 ranks."""
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import fully_shard

    from shardgather import adapters
    from shardgather._memory import peak_rss_rise, trim

    base, _ = _llama(
        0,
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=36,
        num_key_value_heads=4,
    )
    lora = LoraConfig(r=256, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
    pm = get_peft_model(base, lora)
    for layer in pm.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(pm)
    names = sg.adapter_keys(pm)
    out: dict = {
        "adapter_bytes": sum(pm.get_parameter(k).numel() * 4 for k in names),
    }
    path = os.path.join(tmp, "merged.safetensors")
    sg.save_full_state_dict(pm, path, merge_adapter="default", bucket_mb=16)  # warm-up
    verbs = {
        "save": lambda: sg.save_full_state_dict(pm, path, merge_adapter="default", bucket_mb=16),
        "save_collective": lambda: sg.save_full_state_dict(
            pm, path, merge_adapter="default", bucket_mb=16, transport="collective"
        ),
        "stream": lambda: [
            None for _ in sg.iter_full_tensors(pm, merge_adapter="default", bucket_mb=16)
        ],
    }
    for name, verb in verbs.items():
        trim()
        with peak_rss_rise() as m:
            verb()
        out[name] = m["peak_rise"]
    # The same save with every factor fetched at once (the adapter whole on every rank,
    # as before the phases): over the bound, so the bound above can fail.
    saved, adapters.FACTOR_BYTES = adapters.FACTOR_BYTES, 1 << 40
    try:
        trim()
        with peak_rss_rise() as m:
            verbs["save"]()
        out["save_all_at_once"] = m["peak_rise"]
    finally:
        adapters.FACTOR_BYTES = saved
    return out


@pytest.mark.distributed
def test_merged_exports_hold_a_phase_of_factors_not_the_adapter(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The merge's factors come a group of layers at a time (FACTOR_BYTES), so a merged
    save or stream stays within the plain save's bound — two buckets + 64 MiB — on every
    rank, whatever the adapter's size; holding the whole adapter breaks that bound."""
    res = dist_harness.run(
        "tests.test_adapters:merged_memory_worker", 2, tmp=str(tmp_path), timeout=400
    )
    MiB = 2**20
    bound = 2 * 16 * MiB + 64 * MiB
    for r in res:
        assert r["adapter_bytes"] > bound + 32 * MiB, r
        for name in ("save", "save_collective", "stream"):
            assert r[name] <= bound, (name, r)
        assert r["save_all_at_once"] > bound, r


def test_merged_delta_rows_are_the_whole_products_rows() -> None:
    """A merged export adds the delta a slice of rows at a time (and a shard may start
    mid-weight): every slice, one row up to all of them, must be bit for bit the rows
    of PEFT's whole-weight ``B @ A * scaling`` — GEMMs of a few rows take other BLAS
    kernels (on AVX-512 machines 1-3, 5-7 and 9-11 rows rounded differently)."""
    from shardgather.adapters import _Lora

    g = torch.Generator().manual_seed(0)
    lora = _Lora("m.", "default", 0.5)
    out_f, r, in_f = 40, 16, 64
    factors = {
        lora.a_key: torch.randn(r, in_f, generator=g),
        lora.b_key: torch.randn(out_f, r, generator=g),
    }
    whole = (factors[lora.b_key].float() @ factors[lora.a_key].float()) * 0.5
    rows = lora.delta(factors, [torch.empty(0)])
    for r0 in range(out_f):
        for r1 in range(r0 + 1, out_f + 1):
            assert torch.equal(rows(r0, r1), whole[r0:r1]), (r0, r1)
