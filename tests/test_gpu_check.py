"""The prepared GPU check (bench/gpu_check.sh) stays runnable where no GPU is: its
``--cpu-dry-run`` collects the CUDA tests, finds a test for every CUDA path it names,
and runs both benches on tiny sizes — so a lent GPU's minutes go to measuring."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.distributed
def test_the_gpu_check_dry_run_passes_and_names_a_test_for_every_cuda_path(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = dict(os.environ, OUT=str(tmp_path), OMP_NUM_THREADS="1")
    r = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--cpu-dry-run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=ROOT,
    )
    log = (tmp_path / "gpu_check.log").read_text() if (tmp_path / "gpu_check.log").exists() else ""
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + log
    assert "dry run OK" in log and "MISSING" not in log, log
    assert (tmp_path / "cpu-ops.json").exists() and (tmp_path / "cpu-gather.json").exists()


def test_a_cuda_path_without_a_test_fails_the_dry_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The manifest check can fail: a path naming a test that does not exist."""
    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    broken = script.replace(
        "CUDA_PATHS=(\n", 'CUDA_PATHS=(\n  "a path nobody tests|test_that_does_not_exist"\n', 1
    )
    assert broken != script
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "gpu_check.sh").write_text(broken)
    os.symlink(ROOT / "tests", tmp_path / "tests")
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHONPATH=str(ROOT))
    r = subprocess.run(
        ["bash", str(tmp_path / "bench" / "gpu_check.sh"), "--cpu-dry-run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    # Only the bogus path is missing: the real ones were found in the same collection.
    assert r.returncode != 0 and log.count("MISSING") == 1, log
    assert "a path nobody tests" in log, log
