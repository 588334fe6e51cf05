"""What the examples need besides the README's recipe: a process group (torchrun made
the processes), a working directory, a tiny model standing in for yours, a check."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def start() -> int:
    """Join the job torchrun started (gloo: these run on the CPU) and work in argv[1]."""
    dist.init_process_group("gloo")
    if len(sys.argv) > 1:
        os.makedirs(sys.argv[1], exist_ok=True)
        os.chdir(sys.argv[1])
    torch.manual_seed(0)
    return dist.get_rank()


def tiny_llama(seed: int = 0):  # type: ignore[no-untyped-def]
    """A transformers Llama small enough for a test (your model goes here)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config), config


def same(a: dict, b: dict) -> bool:  # type: ignore[type-arg]
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def finish(ok: bool, what: str) -> None:
    """Every rank reports; rank 0 prints the line the test looks for."""
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(ok))
    if dist.get_rank() == 0:
        print(f"{what}: {'OK' if all(flags) else 'FAILED'}")
    dist.destroy_process_group()
    if not all(flags):
        sys.exit(1)
