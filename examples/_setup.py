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
    """Every rank reports; rank 0 prints the line the test looks for.

    The reports go through the job's store, not a collective: a gloo collective as the
    last act races the interpreter's exit while a wrapper (Accelerate's DDP) still holds
    the default group — destroy_process_group() does not join gloo's workers, and a
    worker freeing the last collective's Python tensors after finalization began takes
    the process down with SIGABRT ("terminate called without an active exception"),
    about one exit in eight."""
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    key = f"examples/{what}"
    store.set(f"{key}/ok/{rank}", "1" if ok else "0")
    flags = [store.get(f"{key}/ok/{r}") == b"1" for r in range(world)]  # get() waits
    store.set(f"{key}/read/{rank}", "1")
    store.wait([f"{key}/read/{r}" for r in range(world)])  # nobody leaves before all read
    if rank == 0:
        print(f"{what}: {'OK' if all(flags) else 'FAILED'}")
    dist.destroy_process_group()
    if not all(flags):
        sys.exit(1)
