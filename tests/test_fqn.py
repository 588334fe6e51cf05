from __future__ import annotations

import pytest

import shardgather as sg
from shardgather._fqn import has_wrapper_components

CASES = {
    "fsdp1": ("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.fc.weight", "layers.0.fc.weight"),
    "ac": ("layers.0._checkpoint_wrapped_module.weight", "layers.0.weight"),
    "ddp": ("module.fc.bias", "fc.bias"),
    "compile-ddp": ("_orig_mod.module.fc.bias", "fc.bias"),
    "inner-module-kept": ("blocks.module.weight", "blocks.module.weight"),
    "plain": ("a.b", "a.b"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_clean_fqn(case: str) -> None:
    raw, clean = CASES[case]
    assert sg.clean_fqn(raw) == clean
    assert not has_wrapper_components(clean) or clean.startswith("blocks.module")


def test_flat_param_keys_are_detected() -> None:
    assert has_wrapper_components("_fsdp_wrapped_module._flat_param")
    assert has_wrapper_components("model._flat_param")
