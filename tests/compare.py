"""Bit-exact state dict comparison that reports every difference, by key."""

from __future__ import annotations

import torch


def diff_state_dicts(
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    *,
    order: bool = True,
    strides: bool = True,
) -> list[str]:
    problems: list[str] = []
    if set(got) != set(want):
        problems.append(
            f"keys differ: missing {sorted(set(want) - set(got))}, "
            f"unexpected {sorted(set(got) - set(want))}"
        )
    elif order and list(got) != list(want):
        problems.append(f"key order differs:\n got  {list(got)}\n want {list(want)}")
    for k in want:
        if k not in got:
            continue
        a, b = got[k], want[k].detach().cpu()
        if a.dtype != b.dtype or a.shape != b.shape:
            problems.append(f"{k}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}")
        elif not torch.equal(a, b):
            problems.append(f"{k}: values differ (max abs {(a.double() - b.double()).abs().max()})")
        elif strides and a.stride() != b.stride():
            problems.append(f"{k}: stride {a.stride()} != {b.stride()}")
        if a.device.type != "cpu":
            problems.append(f"{k}: on {a.device}, expected cpu")
    return problems
