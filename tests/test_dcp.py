"""Loading torch.distributed.checkpoint (DCP) directories: written by real dcp.save from
plain, FSDP1 and FSDP2 models, read without pickle's full powers, each rank reading its
own bytes only."""

from __future__ import annotations

import os
import pickle
import warnings

import pytest
import torch

import shardgather as sg
from shardgather.errors import CheckpointError

from . import dist_harness
from .compare import diff_state_dicts
from .test_hf_save import _llama, _plain

dcp = pytest.importorskip("torch.distributed.checkpoint")


def _save_plain(state: dict, d: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=d, no_dist=True)


def test_a_plain_dcp_directory_loads_bit_exactly_and_casts(tmp_path) -> None:
    src = _llama(0)
    d = str(tmp_path / "dcp")
    _save_plain(src.state_dict(), d)
    dst = _llama(1)
    result = sg.load_full_state_dict(dst, d)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert not diff_state_dicts(_plain(dst), _plain(src))
    # bf16 model from an fp32 directory, and a bf16 directory into an fp32 model.
    half = _llama(2).bfloat16()
    sg.load_full_state_dict(half, d)
    want = {k: v.bfloat16() for k, v in _plain(src).items()}
    assert not diff_state_dicts(_plain(half), want)
    d16 = str(tmp_path / "dcp16")
    _save_plain(half.state_dict(), d16)
    back = _llama(3)
    sg.load_full_state_dict(back, d16)
    assert not diff_state_dicts(_plain(back), {k: v.float() for k, v in want.items()})


def test_nested_app_state_with_key_map(tmp_path) -> None:
    """What training loops save: {"model": ..., "optim": ..., "step": int}; DCP
    flattens it to "model.<key>"; a key map picks the model's part."""
    src = _llama(0)
    d = str(tmp_path / "dcp")
    opt = torch.optim.Adam(src.parameters())
    src(torch.arange(4).view(1, -1)).logits.sum().backward()
    opt.step()
    _save_plain({"model": src.state_dict(), "optim": opt.state_dict(), "step": 7}, d)
    dst = _llama(1)
    with pytest.raises(sg.StateDictMismatchError, match=r"model\.model\.embed_tokens\.weight"):
        sg.load_full_state_dict(dst, d)  # nothing matches without the map
    sg.load_full_state_dict(
        dst, d, key_map=lambda k: k[len("model.") :] if k.startswith("model.") else None
    )
    assert not diff_state_dicts(_plain(dst), _plain(src))


def test_untrusted_metadata_is_never_executed(tmp_path) -> None:
    d = tmp_path / "dcp"
    _save_plain(_llama(0).state_dict(), str(d))
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.system, (f"touch {marker}",))

    (d / ".metadata").write_bytes(pickle.dumps(Evil()))
    before = _plain(dst := _llama(1))
    with pytest.raises(CheckpointError, match=r"refusing to unpickle (posix|os)\.system"):
        sg.load_full_state_dict(dst, str(d))
    assert not marker.exists()
    assert not diff_state_dicts(_plain(dst), before)


def test_damaged_directories_are_refused_before_anything_changes(tmp_path) -> None:
    src = _llama(0)
    d = tmp_path / "dcp"
    _save_plain(src.state_dict(), str(d))
    (data,) = [p for p in d.iterdir() if p.suffix == ".distcp"]
    dst = _llama(1)
    before = _plain(dst)
    good = data.read_bytes()
    data.write_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        sg.load_full_state_dict(dst, str(d))
    # Chunks whose zip end records are damaged: found when the chunks are located,
    # before any tensor is loaded.
    data.write_bytes(good.replace(b"PK\x05\x06", b"XX\x05\x06"))
    with pytest.raises(CheckpointError, match="nothing was loaded"):
        sg.load_full_state_dict(dst, str(d))
    data.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        sg.load_full_state_dict(dst, str(d))
    (d / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="not readable DCP metadata"):
        sg.load_full_state_dict(dst, str(d))
    assert not diff_state_dicts(_plain(dst), before)


# ------------------------------------------------------------------ real FSDP processes


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def dcp_worker(rank: int, world: int, root: str) -> dict:  # type: ignore[type-arg]
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.tensor import Shard, distribute_tensor
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    def fsdp2(seed: int) -> torch.nn.Module:
        m = _llama(seed)
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(m, mesh=mesh)

    def fsdp1(seed: int) -> torch.nn.Module:
        return FSDP(
            _llama(seed),
            auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
            device_id=torch.device("cpu"),
        )

    mesh = init_device_mesh("cpu", (world,))
    want = _plain(_llama(0))
    problems: list[str] = []
    # Out with torch's own sharded state dicts: DTensors (FSDP2), ShardedTensors (FSDP1).
    dcp.save(get_model_state_dict(fsdp2(0)), checkpoint_id=os.path.join(root, "fsdp2"))
    dcp.save(get_model_state_dict(fsdp1(0)), checkpoint_id=os.path.join(root, "fsdp1"))
    # Chunks that are not FSDP's even row blocks: 5 rows over 2 ranks, and columns.
    torch.manual_seed(0)
    odd, cols = torch.randn(5, 3), torch.randn(4, 6)
    boxes = {
        "odd": distribute_tensor(odd, mesh, [Shard(0)]),
        "cols": distribute_tensor(cols, mesh, [Shard(1)]),
    }
    dcp.save(boxes, checkpoint_id=os.path.join(root, "boxes"))
    # In, crossed: FSDP1 reads FSDP2's chunks and the other way round. Each rank reads
    # the metadata, its chunks' small zip directories, and its own bytes: nothing more.
    md_bytes = os.path.getsize(os.path.join(root, "fsdp2", ".metadata"))
    l1, l2 = fsdp1(5), fsdp2(6)
    own = sum(
        p.numel() * p.element_size()
        for p in {id(p): p for p in l1.parameters()}.values()  # the flat params' shards
    )
    before = _rchar()
    sg.load_full_state_dict(l1, os.path.join(root, "fsdp2"))
    read = _rchar() - before
    sg.load_full_state_dict(l2, os.path.join(root, "fsdp1"))
    for name, m in (("fsdp1<-fsdp2", l1), ("fsdp2<-fsdp1", l2)):
        got = sg.full_state_dict(m)
        if rank == 0:
            problems += [f"{name}: {p}" for p in diff_state_dicts(got, want)]
    return {
        "problems": problems,
        "read": read,
        "own": own,
        "metadata": md_bytes,
        "tensors": len(want),
    }


@pytest.mark.distributed
def test_fsdp1_and_fsdp2_dcp_directories_cross_load_reading_only_own_bytes(tmp_path) -> None:
    results = dist_harness.run("tests.test_dcp:dcp_worker", 2, root=str(tmp_path))
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    for rank, r in enumerate(results):
        # Own bytes, the metadata, and ~1 KB of zip directory and data.pkl per chunk
        # touched (<= 2 per tensor here; measured: 45 KB own, 10 KB metadata, 20 KB).
        overhead = r["metadata"] + 2 * r["tensors"] * 1024
        assert r["own"] <= r["read"] <= r["own"] + overhead, (rank, r)
    # Plain models read the same directories whole, and the non-row-block chunks.
    for name in ("fsdp1", "fsdp2"):
        dst = _llama(9)
        sg.load_full_state_dict(dst, str(tmp_path / name))
        assert not diff_state_dicts(_plain(dst), _plain(_llama(0))), name
    torch.manual_seed(0)
    odd, cols = torch.randn(5, 3), torch.randn(4, 6)
    boxes = torch.nn.Module()
    boxes.odd = torch.nn.Parameter(torch.zeros(5, 3))
    boxes.cols = torch.nn.Parameter(torch.zeros(4, 6))
    sg.load_full_state_dict(boxes, str(tmp_path / "boxes"))
    assert torch.equal(boxes.odd, odd) and torch.equal(boxes.cols, cols)
