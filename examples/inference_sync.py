# ruff: noqa: E402, B007
"""The README's sync-into-an-inference-process recipe, as pasted: a policy trained with
FSDP2 on 2 CPU processes sends its weights after every step to an inference worker — a
process of its own (started here by rank 0), holding a plain bf16 copy of the model —
first in full, then only what changed:

    torchrun --standalone --nproc_per_node 2 examples/inference_sync.py /tmp/sg-infer
"""

import os
import subprocess
import sys

import torch

trainer_host, port, steps = "127.0.0.1", int(os.environ.get("SG_SYNC_PORT", "29517")), 3

if "--inference-worker" in sys.argv:  # the inference side, in its own process
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _setup import tiny_llama

    llm = tiny_llama(seed=1)[0].to(torch.bfloat16)  # the engine's copy, stale
    # --- README block: inference worker, verbatim ---
    import shardgather as sg

    trainers, workers, i = 2, 1, 0  # this worker is the i-th; the trainer's ranks come first
    group = sg.connect_sync_group(trainer_host, port, rank=trainers + i, world_size=trainers + workers)
    receiver = sg.WeightReceiver(group, target=llm.state_dict())  # written in place
    for step in range(steps):
        receiver.receive()  # the first sync: everything; then only what changed
    # --- end of the block ---
    sg.save_full_state_dict(llm, sys.argv[-1])
    sys.exit(0)

from _setup import finish, same, start, tiny_llama

rank = start()
from torch.distributed.fsdp import fully_shard

model, _ = tiny_llama()  # your policy
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))


def train_step(model):  # type: ignore[no-untyped-def]
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


worker = None
if rank == 0:
    out = os.path.abspath("engine.safetensors")
    worker = subprocess.Popen([sys.executable, __file__, "--inference-worker", out])

# --- README block: weight sender, verbatim ---
import torch.distributed as dist

import shardgather as sg

workers = 1  # every trainer rank joins the inference workers' group, in rank order
group = sg.connect_sync_group(
    trainer_host, port, rank=dist.get_rank(), world_size=dist.get_world_size() + workers
)
sender = sg.WeightSender(model, group, dtype=torch.bfloat16)
for step in range(steps):
    train_step(model)
    sender.sync()  # every rank's own pieces the first time, then only what changed
# --- end of the block ---

want = sg.full_state_dict(model, dtype=torch.bfloat16)
ok = True
if rank == 0:
    assert worker is not None
    ok = worker.wait(timeout=300) == 0 and same(sg.load_file(out), want)
finish(ok, "inference_sync")
