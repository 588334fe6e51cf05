# ruff: noqa: E402
"""The README's saving-while-training loop, as pasted (2 CPU processes, FSDP2):

    torchrun --standalone --nproc_per_node 2 examples/async_save.py /tmp/sg-async
"""

import os

from _setup import finish, same, start, tiny_llama

rank = start()
import torch
from torch.distributed.fsdp import fully_shard

model, _ = tiny_llama()  # your model and optimizer
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
steps, save_every = 5, 2  # yours: e.g. 100_000, 1000
tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))


def train_step(model, optimizer):  # type: ignore[no-untyped-def]
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


# --- README block: async saves, verbatim ---
import shardgather as sg

handle = None
for step in range(steps):
    train_step(model, optimizer)
    if step % save_every == 0:
        if handle is not None:
            handle.wait()  # publishes the previous one (every rank); the next save would too
        handle = sg.save_checkpoint(
            f"ckpt/step_{step}", model, optimizer, extra={"step": step}, blocking=False
        )
if handle is not None:
    handle.wait()
# --- end of the block ---

want = sg.full_state_dict(model, rank0_only=False)
ok = sorted(os.listdir("ckpt")) == ["step_0", "step_2", "step_4"]
ok = ok and same(sg.load_file("ckpt/step_4/model.safetensors"), want)
finish(ok, "async_save")
