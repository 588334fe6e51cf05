"""Clean parameter names: strip what wrappers add, so keys match the plain model."""

from __future__ import annotations

# Path components that wrappers insert between a module and its children.
# FSDP1: `_fsdp_wrapped_module`; activation checkpointing: `_checkpoint_wrapped_module`;
# torch.compile: `_orig_mod`; DDP / DataParallel: `module` (only as a wrapper, see below).
WRAPPER_COMPONENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")
# FSDP1's flat parameter: a key containing it is not a real parameter name.
FLAT_PARAM_COMPONENTS = ("_flat_param", "flat_param")


def clean_fqn(name: str, *, strip_module: bool = True) -> str:
    """Return ``name`` without wrapper path components.

    Args:
        name: a (possibly wrapped) fully-qualified parameter/buffer name.
        strip_module: also strip a *leading* ``module.`` (DDP, DataParallel). Only the
            leading one: ``module`` inside a path can be a real attribute name.

    Returns:
        The name the plain (unwrapped) model uses.

    Example:
        >>> clean_fqn("_fsdp_wrapped_module.layers.0._checkpoint_wrapped_module.weight")
        'layers.0.weight'
        >>> clean_fqn("module._orig_mod.fc.bias")
        'fc.bias'
    """
    parts = name.split(".")
    out: list[str] = []
    leading = True
    for part in parts:
        if part in WRAPPER_COMPONENTS:
            continue
        if leading and strip_module and part == "module":
            continue
        leading = False
        out.append(part)
    return ".".join(out)


def has_wrapper_components(name: str) -> bool:
    """Whether ``name`` still carries wrapper prefixes or a flat-parameter component."""
    parts = name.split(".")
    return (
        any(p in WRAPPER_COMPONENTS or p in FLAT_PARAM_COMPONENTS for p in parts)
        or parts[0] == "module"
    )
