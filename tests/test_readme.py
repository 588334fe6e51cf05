"""Every README recipe is a test: each ```python block of README.md is, verbatim, the
marked block of an ``examples/`` script (and each marked block is in the README), and
every script runs as a user runs it — under torchrun, on the CPU — and checks its
result (bit-exact where there is a reference)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))
START = re.compile(r"^# --- README block[^\n]*---\n", re.M)
END = "# --- end of the block ---\n"


def readme_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.M | re.S)


def example_blocks(path: Path) -> list[str]:
    """The marked blocks, dedented: a script that plays two roles (a trainer and the
    inference worker it starts) holds one of them under an ``if``."""
    text = path.read_text()
    starts = re.finditer(r"^[ ]*# --- README block[^\n]*---\n", text, flags=re.M)
    return [
        textwrap.dedent(
            text[
                m.end() : re.compile(r"^[ ]*" + re.escape(END), re.M).search(text, m.end()).start()
            ]
        )
        for m in starts
    ]


def test_every_readme_recipe_is_an_example_and_every_example_is_in_the_readme() -> None:
    readme = readme_blocks()
    examples = {b: p.name for p in EXAMPLES for b in example_blocks(p)}
    assert len(readme) >= 8
    missing = [b.splitlines()[0] for b in readme if b not in examples]
    assert not missing, f"README blocks no example runs (first lines): {missing}"
    stale = [f"{p} ({b.splitlines()[0]})" for b, p in examples.items() if b not in readme]
    assert not stale, f"example blocks the README no longer shows: {stale}"


def _nproc(path: Path) -> int:
    found = re.search(r"--nproc_per_node (\d+)", path.read_text())
    assert found, f"{path.name}: its docstring names no torchrun command"
    return int(found.group(1))


@pytest.mark.distributed
@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_as_pasted(example: Path, tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc_per_node", str(_nproc(example)), str(example), str(tmp_path / "work")]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400, cwd=tmp_path)
    assert r.returncode == 0 and f"{example.stem}: OK" in r.stdout, (
        r.stdout[-3000:] + r.stderr[-6000:]
    )
