"""Writing the Hugging Face directory layout: save_full_state_dict(max_shard_size=...)
against what the real transformers ``save_pretrained`` writes and ``from_pretrained``
reads; key maps and pass-through files; atomic replacement of an existing directory;
FSDP1 <-> FSDP2 <-> plain round trips in real gloo processes."""

from __future__ import annotations

import filecmp
import json
import os

import pytest
import torch

import shardgather as sg
from shardgather._engine import pieces, sinks
from shardgather.errors import CheckpointError, ShardGatherError
from shardgather.io.hf_layout import parse_size, split_shards
from shardgather.io.safetensors_format import read_header

from . import dist_harness
from .compare import diff_state_dicts

transformers = pytest.importorskip("transformers")

INDEX = "model.safetensors.index.json"


def _llama(seed: int, tie: bool = True) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def _plain(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _index(d: str) -> dict:  # type: ignore[type-arg]
    with open(os.path.join(d, INDEX)) as f:
        return json.load(f)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.arange(10).view(1, -1)).logits


@pytest.mark.parametrize("tie", [True, False])
def test_directory_is_what_save_pretrained_writes_and_from_pretrained_reads(
    tmp_path, tie: bool
) -> None:
    src = _llama(0, tie)
    theirs, ours = str(tmp_path / "theirs"), str(tmp_path / "ours")
    src.save_pretrained(theirs, max_shard_size="20KB")
    sg.save_full_state_dict(
        src, ours, max_shard_size="20KB", files={"config.json": src.config.to_json_string()}
    )
    a, b = _index(theirs), _index(ours)
    # The same stored keys (a tied lm_head stored once), sizes and parameter count.
    assert set(a["weight_map"]) == set(b["weight_map"])
    assert a["metadata"] == b["metadata"]
    names = sorted(f for f in os.listdir(ours) if f.endswith(".safetensors"))
    n = len(names)
    assert n > 2 and names == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(b["weight_map"].values()) == set(names)
    for name in names:  # no file past the limit unless one tensor alone is bigger
        h = read_header(os.path.join(ours, name))
        data = sum(t.end - t.begin for t in h.tensors.values())
        assert data <= parse_size("20KB") or len(h.tensors) == 1
    # Files follow the model's order at tensor boundaries.
    stored = [k for name in names for k in read_header(os.path.join(ours, name)).tensors]
    assert stored == [k for k in src.state_dict() if k in b["weight_map"]]
    back = transformers.LlamaForCausalLM.from_pretrained(ours).eval()
    assert not diff_state_dicts(_plain(back), _plain(src))
    assert torch.equal(_logits(back), _logits(src))
    # And our loader restores it, tie included.
    dst = _llama(1, tie)
    sg.load_full_state_dict(dst, ours)
    assert not diff_state_dicts(_plain(dst), _plain(src))
    if tie:
        assert dst.lm_head.weight.data_ptr() == dst.model.embed_tokens.weight.data_ptr()


def test_one_shard_is_model_safetensors_without_index(tmp_path) -> None:
    src = _llama(0)
    d = str(tmp_path / "one")
    sg.save_full_state_dict(src, d, max_shard_size="5GB", dtype=torch.bfloat16)
    assert sorted(os.listdir(d)) == ["model.safetensors"]
    dst = _llama(1)
    sg.load_full_state_dict(dst, d)
    want = {k: v.to(torch.bfloat16).float() for k, v in _plain(src).items()}
    assert not diff_state_dicts(_plain(dst), want)


def test_key_map_and_files_on_save(tmp_path) -> None:
    inner = _llama(0).model  # a LlamaModel: keys without "model."
    d = str(tmp_path / "mapped")
    cfg = {"hidden_size": 32, "note": "passed through"}
    blob = tmp_path / "tokenizer.json"
    blob.write_bytes(b'{"tok": 1}')
    sg.save_full_state_dict(
        inner,
        d,
        max_shard_size="20KB",
        key_map={"": "model."},
        files={"config.json": cfg, "tokenizer.json": blob, "README.md": "# card\n"},
    )
    assert all(k.startswith("model.") for k in _index(d)["weight_map"])
    with open(os.path.join(d, "config.json")) as f:
        assert json.load(f) == cfg
    assert filecmp.cmp(blob, os.path.join(d, "tokenizer.json"), shallow=False)
    with open(os.path.join(d, "README.md")) as f:
        assert f.read() == "# card\n"
    back = _llama(1).model
    sg.load_full_state_dict(back, d, key_map={"model.": ""})
    assert not diff_state_dicts(_plain(back), _plain(inner))
    # The callable form; dropping a key is refused (a checkpoint stores every key).
    d2 = str(tmp_path / "called")
    sg.save_full_state_dict(inner, d2, max_shard_size="20KB", key_map=lambda k: "model." + k)
    assert _index(d2)["weight_map"] == _index(d)["weight_map"]
    with pytest.raises(ShardGatherError, match="drops the model's"):
        sg.save_full_state_dict(inner, d2, max_shard_size="20KB", key_map=lambda k: None)
    with pytest.raises(ShardGatherError, match="sends both"):
        sg.save_full_state_dict(inner, d2, max_shard_size="20KB", key_map=lambda k: "x")


def test_an_existing_directory_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch) -> None:
    d = tmp_path / "run"
    sg.save_full_state_dict(_llama(0), str(d), max_shard_size="10KB")
    (d / "config.json").write_text("{}")
    (d / "tokenizer").mkdir()
    (d / "tokenizer" / "vocab.txt").write_text("a b c")
    old_shards = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    before = {f: (d / f).read_bytes() for f in os.listdir(d) if (d / f).is_file()}

    # A failure mid-stream: the directory is as it was, no temporary left beside it.
    real = sinks.pwrite_from
    calls = [0]

    def full_disk(*a, **k):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] > 3:
            raise OSError(28, "No space left on device (simulated)")
        return real(*a, **k)

    monkeypatch.setattr(sinks, "pwrite_from", full_disk)
    monkeypatch.setattr(pieces, "pwrite_from", full_disk)
    with pytest.raises(ShardGatherError, match="No space left"):
        sg.save_full_state_dict(_llama(1), str(d), max_shard_size="20KB")
    monkeypatch.setattr(sinks, "pwrite_from", real)
    monkeypatch.setattr(pieces, "pwrite_from", real)
    assert sorted(os.listdir(tmp_path)) == ["run"]
    assert {f: (d / f).read_bytes() for f in os.listdir(d) if (d / f).is_file()} == before

    # A success: new shards and index, old shards gone, the other files kept.
    src = _llama(1)
    sg.save_full_state_dict(src, str(d), max_shard_size="20KB")
    new_shards = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    assert new_shards != old_shards and set(new_shards) == set(
        _index(str(d))["weight_map"].values()
    )
    assert (d / "config.json").read_text() == "{}"
    assert (d / "tokenizer" / "vocab.txt").read_text() == "a b c"
    assert sorted(os.listdir(tmp_path)) == ["run"]
    dst = _llama(2)
    sg.load_full_state_dict(dst, str(d))
    assert not diff_state_dicts(_plain(dst), _plain(src))
    # A directory saved down to one shard drops the now stale index.
    sg.save_full_state_dict(src, str(d), max_shard_size="1GB")
    assert not os.path.exists(d / INDEX) and os.path.exists(d / "model.safetensors")


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path) -> None:
    m = _llama(0)
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"old")
    with pytest.raises(CheckpointError, match="names a file"):
        sg.save_full_state_dict(m, str(f), max_shard_size="1MB")
    assert f.read_bytes() == b"old"
    (tmp_path / "plain").write_bytes(b"old")  # not .safetensors, and not a directory
    with pytest.raises(CheckpointError, match="not a directory"):
        sg.save_full_state_dict(m, str(tmp_path / "plain"), max_shard_size="1MB")
    assert (tmp_path / "plain").read_bytes() == b"old"
    with pytest.raises(ShardGatherError, match="pass a directory path"):
        sg.save_full_state_dict(m, str(tmp_path / "d"), files={"config.json": "{}"})
    for bad in ("5XB", "GB", 0, -1, 1.5, True):
        with pytest.raises(CheckpointError, match="max_shard_size"):
            sg.save_full_state_dict(m, str(tmp_path / "d"), max_shard_size=bad)  # type: ignore[arg-type]
    for name in ("../x.json", "sub/x.json", ".hidden", "model-00001-of-00002.safetensors", INDEX):
        with pytest.raises(CheckpointError, match="files"):
            sg.save_full_state_dict(m, str(tmp_path / "d"), max_shard_size="1MB", files={name: "x"})
    with pytest.raises(CheckpointError, match="cannot read"):
        sg.save_full_state_dict(
            m, str(tmp_path / "d"), max_shard_size="1MB", files={"c.json": tmp_path / "none"}
        )
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors", "plain"]


def test_sizes_and_split_rule() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size(" 2.5mb ") == 2_500_000
    assert parse_size("4GiB") == 4 * 2**30 and parse_size(1000) == 1000
    sizes = [("a", 6), ("b", 6), ("big", 25), ("c", 3), ("d", 10), ("e", 1)]
    # b would pass 10: new file; big alone; c+d > 10: new file; d+e fit.
    assert split_shards(sizes, 10) == [["a"], ["b"], ["big"], ["c"], ["d"], ["e"]]
    assert split_shards(sizes, 12) == [["a", "b"], ["big"], ["c"], ["d", "e"]]
    assert split_shards([], 10) == [[]]


# ------------------------------------------------------------------ real FSDP processes


def round_trip_worker(rank: int, world: int, root: str) -> dict:  # type: ignore[type-arg]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    want = _plain(_llama(0))
    problems: list[str] = []
    m2 = _llama(0)
    mesh = init_device_mesh("cpu", (world,))
    for layer in m2.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(m2, mesh=mesh)
    m1 = FSDP(
        _llama(0),
        auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
        device_id=torch.device("cpu"),
    )
    # Out: FSDP2 node-local (every rank pwrites its pieces), FSDP1 through collectives.
    sg.save_full_state_dict(m2, os.path.join(root, "fsdp2"), max_shard_size="20KB")
    sg.save_full_state_dict(
        m1, os.path.join(root, "fsdp1"), max_shard_size="20KB", transport="collective"
    )
    # In, crossed: each loads the other's directory.
    l1 = FSDP(
        _llama(5),
        auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
        device_id=torch.device("cpu"),
    )
    sg.load_full_state_dict(l1, os.path.join(root, "fsdp2"))
    l2 = _llama(6)
    for layer in l2.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(l2, mesh=mesh)
    sg.load_full_state_dict(l2, os.path.join(root, "fsdp1"))
    for name, m in (("fsdp1<-fsdp2", l1), ("fsdp2<-fsdp1", l2)):
        got = sg.full_state_dict(m)
        if rank == 0:
            problems += [f"{name}: {p}" for p in diff_state_dicts(got, want)]
    return {"problems": problems}


@pytest.mark.distributed
def test_fsdp1_fsdp2_plain_round_trips_through_the_directory(tmp_path) -> None:
    src = _llama(0)
    sg.save_full_state_dict(src, str(tmp_path / "plain"), max_shard_size="20KB")
    results = dist_harness.run("tests.test_hf_save:round_trip_worker", 2, root=str(tmp_path))
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    # All three writers produce the same bytes, and nothing else is left.
    files = sorted(os.listdir(tmp_path / "plain"))
    for other in ("fsdp1", "fsdp2"):
        assert sorted(os.listdir(tmp_path / other)) == files
        match, mismatch, errors = filecmp.cmpfiles(
            tmp_path / "plain", tmp_path / other, files, shallow=False
        )
        assert not mismatch and not errors, (other, mismatch, errors)
    assert sorted(os.listdir(tmp_path)) == ["fsdp1", "fsdp2", "plain"]
    (tmp_path / "fsdp2" / "config.json").write_text(src.config.to_json_string())
    back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "fsdp2")).eval()
    assert torch.equal(_logits(back), _logits(src))


def test_paths_mean_what_they_look_like(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A trailing "/" (or an existing directory) is the HF layout, one model.safetensors
    inside when it fits; a .safetensors name with max_shard_size is refused; what is
    published is readable by others as transformers' output is (0755 / 0644 under the
    usual umask)."""
    import stat

    from .models import TinyLM

    model = TinyLM(tied=False)
    old = os.umask(0o022)
    try:
        sg.save_full_state_dict(model, str(tmp_path / "out_dir") + "/")
        out = tmp_path / "out_dir"
        assert out.is_dir() and sorted(os.listdir(out)) == ["model.safetensors"]
        assert stat.S_IMODE(out.stat().st_mode) == 0o755
        assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o644
        (tmp_path / "existing").mkdir()
        (tmp_path / "existing" / "config.json").write_text("{}")
        sg.save_full_state_dict(model, tmp_path / "existing", max_shard_size=2000)
        names = sorted(os.listdir(tmp_path / "existing"))
        assert "config.json" in names and "model.safetensors.index.json" in names, names
        sg.save_full_state_dict(model, tmp_path / "one.safetensors")
        assert stat.S_IMODE((tmp_path / "one.safetensors").stat().st_mode) == 0o644
        with pytest.raises(sg.CheckpointError, match=r"names a file.*'.*m/'"):
            sg.save_full_state_dict(model, tmp_path / "m.safetensors", max_shard_size="1GB")
        assert not (tmp_path / "m.safetensors").exists()
        want = model.state_dict()
        for p in (out, tmp_path / "existing", tmp_path / "one.safetensors"):
            other = TinyLM(tied=False)
            sg.load_full_state_dict(other, p)
            assert all(torch.equal(other.state_dict()[k], v) for k, v in want.items())
    finally:
        os.umask(old)
