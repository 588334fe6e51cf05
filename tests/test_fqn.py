from __future__ import annotations

import pytest
import torch

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


class _Delegating(torch.nn.Module):
    """A user wrapper that shows its inner module's state (as Lightning's _FabricModule)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.forward_module = inner  # the same module under two names
        self.original = inner

    def state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self.original.state_dict(*args, **kwargs)


class _Container(torch.nn.Module):
    """Registers one module twice and does not override state_dict: torch prefixes both."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.a = inner
        self.b = inner


class _AddsState(torch.nn.Module):
    """Overrides state_dict but holds a tensor of its own: not a pure delegate."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.scale = torch.nn.Parameter(torch.ones(2))

    def state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return super().state_dict(*args, **kwargs)


@pytest.mark.parametrize(
    "wrap",
    [_Delegating, _Container, _AddsState, lambda m: _Delegating(_Delegating(m))],
    ids=["delegating_wrapper", "module_registered_twice", "overrides_but_owns_state", "nested"],
)
def test_keys_equal_what_the_module_itself_reports(wrap) -> None:  # type: ignore[no-untyped-def]
    import shardgather as sg

    from .compare import diff_state_dicts
    from .models import TinyLM

    torch.manual_seed(0)
    model = wrap(TinyLM())
    assert not diff_state_dicts(sg.full_state_dict(model), model.state_dict())
