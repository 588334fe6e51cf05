"""full_state_dict on real FSDP1/FSDP2 models in 2-4 gloo processes, bit-exact
against the plain model (before training) and torch's own full state dict (after)."""

from __future__ import annotations

import os

import pytest
import torch

import shardgather as sg

from . import dist_harness
from .compare import diff_state_dicts
from .models import TinyLM
from .scenarios import FSDP1_CASES, FSDP2_CASES, MIXED_HOST_CASES

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("case", list(FSDP1_CASES))
def test_fsdp1(case: str) -> None:
    world, _ = FSDP1_CASES[case]
    results = dist_harness.run("tests.scenarios:fsdp1_case", world, case=case)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert results[0]["keys"] > 0


@pytest.mark.parametrize("case", list(FSDP2_CASES))
def test_fsdp2(case: str) -> None:
    world, _ = FSDP2_CASES[case]
    results = dist_harness.run("tests.scenarios:fsdp2_case", world, case=case)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)


def test_fsdp1_channels_last_conv_keeps_plain_stride() -> None:
    results = dist_harness.run("tests.scenarios:fsdp1_channels_last", 2)
    assert not results[0]["problems"], results[0]["problems"]


def test_ddp_wrapped() -> None:
    results = dist_harness.run("tests.scenarios:ddp_case", 2)
    assert not results[0]["problems"], results[0]["problems"]


def test_mismatched_models_raise_on_every_rank() -> None:
    results = dist_harness.run("tests.scenarios:mismatched_models", 2)
    for r in results:
        assert r["raised"] == "CollectiveError", r
        assert "same" in r["message"]


def test_rank_dying_mid_gather_raises_instead_of_hanging() -> None:
    results = dist_harness.run(
        "tests.scenarios:rank_fails_midway", 2, timeout=120, _allow_missing=(1,)
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
        "tests.scenarios:node_local_rank_dies", 2, timeout=120, _allow_missing=(1,)
    )
    assert results[0]["raised"] is not None, results[0]
    assert results[0]["leaked"] == []


def test_shm_too_small_falls_back_with_one_warning() -> None:
    results = dist_harness.run("tests.scenarios:shm_too_small", 2, memfd=False)
    assert not [p for r in results for p in r["problems"]]
    assert len(results[0]["warnings"]) == 1 and "free" in results[0]["warnings"][0]
    assert not results[0]["node_local"]


def test_full_dev_shm_does_not_matter_with_a_memfd() -> None:
    # Docker caps /dev/shm at 64 MiB by default; rank 0's memfd is not in /dev/shm.
    results = dist_harness.run("tests.scenarios:shm_too_small", 2, memfd=True)
    assert not [p for r in results for p in r["problems"]]
    assert results[0]["warnings"] == [] and results[0]["node_local"]


@pytest.mark.parametrize("case", list(MIXED_HOST_CASES))
def test_ranks_on_other_hosts_send_their_pieces(case: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, hosts = MIXED_HOST_CASES[case]
    results = dist_harness.run(
        "tests.scenarios:mixed_hosts", len(hosts), path=str(tmp_path / "m.safetensors"), case=case
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
        "tests.scenarios:mixed_hosts_sender_fails",
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
