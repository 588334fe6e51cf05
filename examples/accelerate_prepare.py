# ruff: noqa: E402, B007
"""The README's Accelerate recipe, as pasted (2 CPU processes; Accelerate wraps in DDP
there — its FSDP plugin needs GPUs, and the recipe is the same):

    torchrun --standalone --nproc_per_node 2 examples/accelerate_prepare.py /tmp/sg-accelerate
"""

import os

from _setup import finish, same, start, tiny_llama

start()
import torch


def build_model():  # type: ignore[no-untyped-def]
    return tiny_llama()[0]  # your model


tokens = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(0))
data = torch.utils.data.DataLoader(tokens, batch_size=2)  # your data

# What `accelerate launch --cpu` sets: without it Accelerate on a machine with no GPU
# runs every process alone (DistributedType.NO: no DDP, ranks training apart). On GPUs
# leave it out.
os.environ["ACCELERATE_USE_CPU"] = "1"

# --- README block: Accelerate, verbatim ---
import torch
from accelerate import Accelerator

import shardgather as sg

accelerator = Accelerator()
model = build_model()
model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
for step, batch in enumerate(data):  # prepared objects go into shardgather as they are
    accelerator.backward(model(input_ids=batch, labels=batch).loss)
    optimizer.step()
    optimizer.zero_grad()
sg.save_checkpoint("ckpt", model, optimizer, extra={"step": step})  # on every process
extra = sg.load_checkpoint("ckpt", model, optimizer)
sg.save_full_state_dict(model, "model.safetensors")  # = accelerator.get_state_dict(model)
# --- end of the block ---

want = accelerator.get_state_dict(model)
ok = extra == {"step": step} and accelerator.num_processes == 2  # really DDP
if accelerator.is_main_process:
    ok = ok and same(sg.load_file("model.safetensors"), want)
finish(ok, "accelerate_prepare")
