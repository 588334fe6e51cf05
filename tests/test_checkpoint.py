"""save_full_state_dict -> safetensors -> load_full_state_dict, across FSDP versions
and world sizes, in real gloo processes; bad files and failures lose nothing."""

from __future__ import annotations

import os

import pytest
import torch

import shardgather as sg

from . import dist_harness
from .compare import diff_state_dicts
from .models import TinyLM

pytestmark = pytest.mark.distributed

ROUND_TRIPS = {
    # id: (world, save kind, load kind, extra kwargs)
    "fsdp1->fsdp1": (2, "fsdp1", "fsdp1", {}),
    "fsdp1->fsdp2": (2, "fsdp1", "fsdp2", {}),
    "fsdp2->fsdp1_orig": (2, "fsdp2", "fsdp1-orig", {}),
    "fsdp1-world3->fsdp2-world3": (3, "fsdp1", "fsdp2", {}),
    "fsdp2->hsdp": (4, "fsdp2", "fsdp2-hsdp", {}),
    "fsdp1->plain": (2, "fsdp1", "plain", {}),
    "bf16_export->fsdp2": (2, "fsdp1", "fsdp2", {"dtype": torch.bfloat16}),
    "small_bucket": (2, "fsdp2", "fsdp1", {"small_bucket": True, "transport": "collective"}),
    "collective-fsdp1->fsdp2": (2, "fsdp1", "fsdp2", {"transport": "collective"}),
    "collective-bf16_export": (
        2,
        "fsdp2",
        "fsdp1",
        {"transport": "collective", "dtype": torch.bfloat16},
    ),
    "collective-hsdp->fsdp1": (4, "fsdp2-hsdp", "fsdp1", {"transport": "collective"}),
}


@pytest.mark.parametrize("case", list(ROUND_TRIPS))
def test_round_trip(case: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    world, save_kind, load_kind, kw = ROUND_TRIPS[case]
    path = str(tmp_path / "model.safetensors")
    results = dist_harness.run(
        "tests.scenarios:save_then_load",
        world,
        path=path,
        save_kind=save_kind,
        load_kind=load_kind,
        **kw,
    )
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]  # no temp files left


def test_load_errors_are_clear_and_lose_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "other.safetensors")
    r = dist_harness.run("tests.scenarios:load_errors", 2, path=path)[0]
    assert r["unexpected_key"][0] == "StateDictMismatchError"
    assert "unexpected keys ['blocks.3." in r["unexpected_key"][1]
    assert r["missing_file"][0] == "CheckpointError" and "no such file" in r["missing_file"][1]
    assert r["unchanged_by_errors"]
    assert r["non_strict"][0] == [] and all(k.startswith("blocks.3.") for k in r["non_strict"][1])
    assert r["non_strict_loaded"]
    assert r["truncated"][0] == "CheckpointError" and "truncated" in r["truncated"][1]


@pytest.mark.parametrize("transport", ["auto", "collective", "auto-directory"])
def test_failed_save_on_one_rank_leaves_nothing(tmp_path, transport) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "model.safetensors")
    if transport == "auto-directory":  # the Hugging Face layout, several files
        path = str(tmp_path / "hf")
    results = dist_harness.run(
        "tests.scenarios:save_fails_on_one_rank", 2, path=path, transport=transport
    )
    for r in results:
        assert r["raised"] is not None and "No space left" in r["raised"][1], r
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("transport", ["auto", "collective", "checkpoint"])
def test_save_where_rank0_cannot_create_raises_on_every_rank(tmp_path, transport) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "blocker").write_text("a file where a directory should be")
    path = str(tmp_path / "blocker" / "model.safetensors")
    results = dist_harness.run(
        "tests.scenarios:save_into_missing_dir", 2, path=path, transport=transport, timeout=120
    )
    for r in results:
        assert r["raised"] is not None and r["raised"][0] == "CheckpointError", r
        assert "directory exists" in r["raised"][1], r
    assert os.listdir(tmp_path) == ["blocker"]


def test_plain_model_round_trip_single_process(tmp_path) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = TinyLM()
    path = tmp_path / "m.safetensors"
    sg.save_full_state_dict(model, path)
    fresh = TinyLM()
    fresh.load_state_dict(sg.load_file(path))
    assert not diff_state_dicts(fresh.state_dict(), model.state_dict())


@pytest.mark.parametrize(
    "garbage",
    [b"", b"abc", b"\xff" * 64, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}...."],
    ids=["empty", "short", "huge-header", "bad-json"],
)
def test_not_a_safetensors_file(tmp_path, garbage: bytes) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(garbage)
    with pytest.raises(sg.CheckpointError):
        sg.load_full_state_dict(TinyLM(), path)


def test_shape_mismatch_names_the_key_and_changes_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "m.safetensors"
    sg.save_full_state_dict(TinyLM(d=16), path)
    model = TinyLM()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(sg.StateDictMismatchError, match=r"embed\.weight: shape \(37, 16\)"):
        sg.load_full_state_dict(model, path)
    assert not diff_state_dicts(model.state_dict(), before)


@pytest.mark.parametrize(
    ("load_kind", "world"), [("fsdp2", 2), ("fsdp1-orig", 3), ("fsdp2-hsdp", 4)]
)
def test_load_from_torch_file_and_dicts(tmp_path, load_kind: str, world: int) -> None:  # type: ignore[no-untyped-def]
    results = dist_harness.run(
        "tests.scenarios:load_sources",
        world,
        path=str(tmp_path / "model.pt"),
        load_kind=load_kind,
    )
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("kind", ["fsdp1", "fsdp2"])
def test_load_reads_only_each_ranks_own_bytes(tmp_path, kind: str) -> None:  # type: ignore[no-untyped-def]
    results = dist_harness.run(
        "tests.scenarios:load_reads_only_own_bytes",
        2,
        path=str(tmp_path / "m.safetensors"),
        kind=kind,
    )
    for r in results:
        # Own elements + the header + collectives' small messages; never the whole file.
        assert r["own"] <= r["read"] <= r["own"] + 2**20, r
        assert r["own"] < 0.6 * r["file"], r
