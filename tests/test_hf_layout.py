"""Loading Hugging Face layouts written by the real transformers ``save_pretrained``:
sharded directories (index + shard files), index files, single-file directories, key
maps, casts; FSDP1 and FSDP2 in real gloo processes; a damaged index is refused before
anything changes."""

from __future__ import annotations

import json
import os

import pytest
import torch

import shardgather as sg
from shardgather.errors import CheckpointError, StateDictMismatchError

from . import dist_harness
from .compare import diff_state_dicts

transformers = pytest.importorskip("transformers")


def _llama(seed: int, tie: bool = True, hidden: int = 32) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def _saved(tmp_path, model: torch.nn.Module, shard: str | None = "20KB") -> str:  # type: ignore[no-untyped-def]
    d = str(tmp_path / "hf")
    if shard is None:
        model.save_pretrained(d)
    else:
        model.save_pretrained(d, max_shard_size=shard)
    return d


def _plain(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("tie", [True, False])
def test_sharded_directory_loads_bit_exactly_with_identical_logits(tmp_path, tie: bool) -> None:
    src = _llama(0, tie)
    d = _saved(tmp_path, src)
    assert len([f for f in os.listdir(d) if f.endswith(".safetensors")]) > 2
    for source in (d, os.path.join(d, "model.safetensors.index.json")):
        dst = _llama(1, tie)
        sg.load_full_state_dict(dst, source)
        assert not diff_state_dicts(_plain(dst), _plain(src))
        ids = torch.arange(10).view(1, -1)
        with torch.no_grad():
            assert torch.equal(dst(ids).logits, src(ids).logits)
        if tie:
            assert dst.lm_head.weight.data_ptr() == dst.model.embed_tokens.weight.data_ptr()


def test_single_file_directory_and_cast_from_bf16(tmp_path) -> None:
    src = _llama(0).to(torch.bfloat16)
    d = _saved(tmp_path, src, shard=None)
    assert "model.safetensors" in os.listdir(d)
    dst = _llama(1)  # fp32
    sg.load_full_state_dict(dst, d)
    want = {k: v.float() for k, v in _plain(src).items()}
    assert not diff_state_dicts(_plain(dst), want)


def test_key_map_prefixes_and_callables(tmp_path) -> None:
    src = _llama(0)
    d = _saved(tmp_path, src)
    want = {k.removeprefix("model."): v for k, v in _plain(src).items() if k.startswith("model.")}
    inner = _llama(1).model  # a LlamaModel: no "model." prefix
    sg.load_full_state_dict(inner, d, key_map={"model.": ""})
    assert not diff_state_dicts(_plain(inner), want)
    inner = _llama(2).model
    sg.load_full_state_dict(inner, d, key_map=lambda k: k.removeprefix("model."))
    assert not diff_state_dicts(_plain(inner), want)
    # A mismatch names the model's key and the file's.
    other = _llama(3, hidden=48).model
    before = _plain(other)
    with pytest.raises(
        StateDictMismatchError,
        match=r"embed_tokens.weight \(source key "
        r"'model.embed_tokens.weight'\)",
    ):
        sg.load_full_state_dict(other, d, key_map={"model.": ""})
    assert not diff_state_dicts(_plain(other), before)
    with pytest.raises(CheckpointError, match="sends both"):
        sg.load_full_state_dict(_llama(4), d, key_map=lambda k: "x")


def _break(d: str, how: str) -> None:
    index = os.path.join(d, "model.safetensors.index.json")
    with open(index) as f:
        doc = json.load(f)
    wm = doc["weight_map"]
    # A shard file with several keys (so that the index still names it after one goes).
    first = next(f for f in sorted(set(wm.values())) if list(wm.values()).count(f) > 1)
    key = next(k for k, v in wm.items() if v == first)
    other = next(v for v in sorted(set(wm.values())) if v != first)
    if how == "missing_file":
        os.unlink(os.path.join(d, first))
    elif how == "outside":
        wm[key] = "../" + first
    elif how == "wrong_file":
        wm[key] = other
    elif how == "phantom":
        wm["model.norm.extra"] = first
    elif how == "unlisted":
        del wm[key]
    elif how == "not_json":
        with open(index, "w") as f:
            f.write("{not json")
        return
    elif how == "stored_twice":
        # Another shard that also stores `key` (a copy of its file), listed in the index.
        import shutil

        shutil.copy(os.path.join(d, first), os.path.join(d, "dup.safetensors"))
        for k, v in list(wm.items()):
            if v == first and k != key:
                wm[k] = "dup.safetensors"
    with open(index, "w") as f:
        json.dump(doc, f)


@pytest.mark.parametrize(
    "how, message",
    [
        ("missing_file", "the file is missing"),
        ("outside", "not a file name in the index's directory"),
        ("wrong_file", "but it is stored in"),
        ("phantom", "which does not store it"),
        ("unlisted", "does not list"),
        ("not_json", "not a readable JSON index"),
        ("stored_twice", "is stored in both"),
    ],
)
def test_a_damaged_index_is_refused_before_anything_changes(
    tmp_path, how: str, message: str
) -> None:
    d = _saved(tmp_path, _llama(0))
    _break(d, how)
    dst = _llama(1)
    before = _plain(dst)
    with pytest.raises(CheckpointError, match=message):
        sg.load_full_state_dict(dst, d)
    assert not diff_state_dicts(_plain(dst), before)


def test_a_directory_with_dcp_metadata_is_read_as_dcp(tmp_path) -> None:
    # (tests/test_dcp.py loads real ones; an empty .metadata is not taken for HF files.)
    d = tmp_path / "dcp"
    d.mkdir()
    (d / ".metadata").write_bytes(b"")
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="not readable DCP metadata"):
        sg.load_full_state_dict(_llama(0), str(d))


def sharded_worker(rank: int, world: int, directory: str, export: str) -> dict:  # type: ignore[type-arg]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    want = _plain(_llama(0))
    problems: list[str] = []
    # FSDP2
    m2 = _llama(1)
    mesh = init_device_mesh("cpu", (world,))
    for layer in m2.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(m2, mesh=mesh)
    sg.load_full_state_dict(m2, directory)
    got = sg.full_state_dict(m2)
    if rank == 0:
        problems += ["fsdp2: " + p for p in diff_state_dicts(got, want)]
    # FSDP1
    m1 = FSDP(
        _llama(2),
        auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
        device_id=torch.device("cpu"),
    )
    sg.load_full_state_dict(m1, directory)
    got = sg.full_state_dict(m1)
    if rank == 0:
        problems += ["fsdp1: " + p for p in diff_state_dicts(got, want)]
    # And back out: one file that transformers' from_pretrained reads (checked by the test).
    sg.save_full_state_dict(m1, os.path.join(export, "model.safetensors"))
    return {"problems": problems}


@pytest.mark.distributed
def test_fsdp1_and_fsdp2_load_a_save_pretrained_directory(tmp_path) -> None:
    src = _llama(0)
    d = _saved(tmp_path, src)
    export = tmp_path / "export"
    export.mkdir()
    src.config.save_pretrained(export)
    results = dist_harness.run(
        "tests.test_hf_layout:sharded_worker", 2, directory=d, export=str(export)
    )
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    back = transformers.LlamaForCausalLM.from_pretrained(str(export)).eval()
    assert not diff_state_dicts(_plain(back), _plain(src))
    ids = torch.arange(10).view(1, -1)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, src(ids).logits)


def test_cli_inspects_a_directory_and_refuses_a_damaged_one(tmp_path, capsys) -> None:
    from shardgather.__main__ import main

    d = _saved(tmp_path, _llama(0))
    n_files = len([f for f in os.listdir(d) if f.endswith(".safetensors")])
    assert main(["inspect", d]) == 0
    out = capsys.readouterr().out
    assert "model.layers.1.mlp.down_proj.weight" in out and f"in {n_files} files" in out
    _break(d, "unlisted")
    assert main(["inspect", os.path.join(d, "model.safetensors.index.json")]) == 2
