# ruff: noqa: E402, B007
"""The README's weight-sync recipe, as pasted: a policy trained with FSDP2 pushes its
weights into an inference engine after every step (2 CPU processes; the engine here is
a plain copy of the model standing in for vLLM's ``load_weights``):

    torchrun --standalone --nproc_per_node 2 examples/weight_sync.py /tmp/sg-sync
"""

from _setup import finish, same, start, tiny_llama

rank = start()
import torch
from torch.distributed.fsdp import fully_shard

model, _ = tiny_llama()  # your policy
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
steps = 3
tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))


def train_step(model):  # type: ignore[no-untyped-def]
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


class Engine:  # stands in for vLLM's model: copies what it is given
    def __init__(self) -> None:
        self.weights = {k: v.to(torch.bfloat16) for k, v in tiny_llama(seed=1)[0].state_dict().items()}

    def load_weights(self, weights) -> None:  # type: ignore[no-untyped-def]
        for name, t in weights:
            self.weights[name].copy_(t)


llm_model = Engine()

# --- README block: weight sync, verbatim ---
import torch

import shardgather as sg

gatherer = sg.Gatherer(model, dtype=torch.bfloat16, rank0_only=False)  # every rank receives
for step in range(steps):
    train_step(model)
    llm_model.load_weights(gatherer.iter_full_tensors())  # vLLM takes the iterator as is
sd = gatherer.full_state_dict()  # the dict verb: the same dict every call, written in place
gatherer.close()
# --- end of the block ---

want = {k: v.to(torch.bfloat16) for k, v in sg.full_state_dict(model, rank0_only=False).items()}
finish(same(llm_model.weights, want) and same(sd, want), "weight_sync")
