"""Rules of the package's structure that reading alone would let slip."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "shardgather"


def test_no_module_imports_another_modules_private_names() -> None:
    # Private *modules* are fine (`from ._plan import build_plan`); a private *name*
    # imported across modules is a helper that should have a public name where it lives.
    offences = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0 and node.module:
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        offences.append(f"{path.relative_to(PACKAGE)}: {node.module}.{alias.name}")
    assert not offences, offences


def test_transport_names_say_what_happens() -> None:
    import warnings

    import pytest
    import torch

    import shardgather as sg

    model = torch.nn.Linear(3, 2)
    want = model.state_dict()
    for transport in ("auto", "node-local", "collective"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)  # current names: none
            warnings.simplefilter("error", RuntimeWarning)  # nothing sharded: no fallback
            got = sg.full_state_dict(model, transport=transport)
        assert all(torch.equal(got[k], want[k]) for k in want)
    with pytest.warns(DeprecationWarning, match="node-local"):
        sg.full_state_dict(model, transport="shm")
    with pytest.raises(sg.ShardGatherError, match="'auto', 'node-local' or 'collective'"):
        sg.full_state_dict(model, transport="nccl")
