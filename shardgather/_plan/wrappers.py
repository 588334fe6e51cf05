"""Which modules are wrappers, and which child holds what they wrap: keys are the
plain module's, whatever sits on top (FSDP1, DDP, torch.compile, activation
checkpointing, and wrappers that delegate ``state_dict()`` to one inner module)."""

from __future__ import annotations

import torch
from torch import nn


def wrapper_child_name(module: nn.Module) -> str | None:
    """The child a wrapper forwards to: its state is that child's, under the same name."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    if isinstance(module, FSDP1):
        return "_fsdp_wrapped_module"
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

        if isinstance(module, ActivationWrapper):
            return "_checkpoint_wrapped_module"
    except ImportError:  # pragma: no cover - older torch
        pass
    if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return "module"
    if type(module).__name__ == "DeepSpeedEngine" and isinstance(
        getattr(module, "module", None), nn.Module
    ):
        return "module"  # its state_dict is its module's (no import of deepspeed here)
    opt_cls = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    opt_cls = getattr(opt_cls, "OptimizedModule", None)
    if opt_cls is not None and isinstance(module, opt_cls):
        return "_orig_mod"
    return _delegate_child_name(module)


def _delegate_child_name(module: nn.Module) -> str | None:
    """The child a *delegating* wrapper hands ``state_dict()`` to, found by structure.

    A module whose class overrides ``state_dict``, that holds no tensors of its own,
    and whose children all reach one and the same module (after the known wrappers:
    FSDP1, DDP, compile, activation checkpointing) can only be showing that module's
    state: Lightning's ``_FabricModule`` registers the user's module twice
    (``_forward_module``, ``_original_module``) and delegates to it; user and
    framework wrappers that forward ``state_dict()`` to one inner module look the
    same. A container that does not override ``state_dict`` is never skipped: torch
    prefixes its children's keys, and so do we.
    """
    if type(module).state_dict is nn.Module.state_dict:
        return None
    if any(p is not None for p in module._parameters.values()) or any(
        b is not None and n not in module._non_persistent_buffers_set
        for n, b in module._buffers.items()
    ):
        return None
    children = [(n, c) for n, c in module._modules.items() if c is not None]
    if not children or len({id(unwrap(c)) for _, c in children}) != 1:
        return None
    target = unwrap(children[0][1])
    # Prefer the child that is the module itself (Lightning's _original_module) over
    # a wrapper of it: the walk unwraps either way.
    return next((n for n, c in children if c is target), children[0][0])


def unwrap(module: nn.Module) -> nn.Module:
    """The innermost module under top-level wrappers (DDP, torch.compile, FSDP1, AC)."""
    while (child := wrapper_child_name(module)) is not None:
        module = getattr(module, child)
    return module
