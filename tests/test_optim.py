"""Full optimizer state: gathered bit-exactly (torch's FSDP2 oracle), and an exact
resume: train N+M steps == train N, save, rebuild, load, train M."""

from __future__ import annotations

import pytest

from . import dist_harness
from .scenarios import OPTIM_CASES

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("case", list(OPTIM_CASES))
def test_exact_resume(case: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    world = OPTIM_CASES[case][0]
    results = dist_harness.run(
        "tests.scenarios:optim_resume", world, path=str(tmp_path / "m.safetensors"), case=case
    )
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)


def test_before_first_step_and_mismatch() -> None:
    r = dist_harness.run("tests.scenarios:optim_edge_cases", 2)[0]
    assert r["empty_state"] and r["groups"] == 2
    assert r["mismatch"] is not None and "nope" in r["mismatch"]
