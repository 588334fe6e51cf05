# ruff: noqa: E402, B007
"""The README's Fabric recipe, as pasted (2 CPU processes, FSDP2):

    torchrun --standalone --nproc_per_node 2 examples/lightning_fabric.py /tmp/sg-fabric
"""

import warnings

from _setup import finish, same, start, tiny_llama

start()
import torch


def build_model():  # type: ignore[no-untyped-def]
    return tiny_llama()[0]  # your model


tokens = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(0))
data = torch.utils.data.DataLoader(tokens, batch_size=2)  # your data
warnings.simplefilter("error", UserWarning)  # the recipe shards: no "unused mesh" warning
warnings.filterwarnings("ignore", module="lightning")  # Lightning's own advice is not ours

# --- README block: Lightning Fabric, verbatim ---
import lightning as L
import torch
from torch.distributed.fsdp import fully_shard

import shardgather as sg
from shardgather.integrations.lightning import FabricModelParallelStrategy


def parallelize(model, mesh):  # FSDP2 over the data-parallel dimension of Fabric's mesh
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["data_parallel"])
    return fully_shard(model, mesh=mesh["data_parallel"])


# Name both sizes: with the defaults ("auto") Fabric puts every process on the
# tensor-parallel dimension and parallelize() would shard nothing (shardgather warns)
strategy = FabricModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1)
fabric = L.Fabric(strategy=strategy, devices=2)  # devices: processes per node
fabric.launch()
model = fabric.setup_module(build_model())
optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
for step, batch in enumerate(data):
    fabric.backward(model(input_ids=batch, labels=batch).loss)
    optimizer.step()
    optimizer.zero_grad()
fabric.save("ckpt", {"model": model, "optimizer": optimizer, "step": step})
state = {"model": model, "optimizer": optimizer, "step": 0}
fabric.load("ckpt", state)  # restores model, optimizer, state["step"]
sg.save_full_state_dict(model, "model.safetensors")  # a _FabricModule: the plain keys
# --- end of the block ---

plain = build_model()
plain.load_state_dict(sg.load_file("model.safetensors"))  # strictly: the plain keys
want = sg.full_state_dict(model, rank0_only=False)
ok = state["step"] == step and same(plain.state_dict(), want)
ok = ok and same(sg.load_file("ckpt/model.safetensors"), want)
finish(ok, "lightning_fabric")
