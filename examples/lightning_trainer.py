# ruff: noqa: E402
"""The README's Lightning recipes, as pasted: the Trainer with shardgather's strategy at
dp 2 x tp 2 (the LitModel of the tensor-parallel section), save and resume, a plain
module loading the export, and the async-save callback and plugin (4 CPU processes):

    torchrun --standalone --nproc_per_node 4 examples/lightning_trainer.py /tmp/sg-lightning
"""

import os
import sys

from _setup import finish, same, tiny_llama

os.makedirs(sys.argv[1], exist_ok=True)
os.chdir(sys.argv[1])  # Lightning writes lightning_logs/ here

os.environ.setdefault("PL_DISABLE_FORK", "1")
import torch


def build_model():  # type: ignore[no-untyped-def]
    return tiny_llama()[0]  # your model


tokens = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(0))
data = torch.utils.data.DataLoader(tokens, batch_size=2)  # your data

# --- README block: the tensor-parallel LightningModule, verbatim ---
import lightning as L
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

tp_plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}


class LitModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = build_model()  # a transformers Llama

    def configure_model(self):  # the mesh comes from the strategy's two sizes
        tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            parallelize_module(layer.mlp, tp, tp_plan)
            fully_shard(layer, mesh=dp)
        fully_shard(self.model, mesh=dp)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
# --- end of the block ---

lit_module = LitModel()

# --- README block: the Lightning Trainer, verbatim ---
import lightning as L

import shardgather as sg
from shardgather.integrations.lightning import ModelParallelStrategy

# Name both sizes: their product is the number of processes (tensor_parallel_size=1 for
# FSDP alone; Lightning's default "auto" would take every device for tensor parallelism)
strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
trainer = L.Trainer(strategy=strategy, devices=4, max_steps=2)  # devices: processes per node
trainer.fit(lit_module, data)
trainer.save_checkpoint("last.ckpt")  # a consolidated directory (ModelCheckpoint's too)

strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
trainer = L.Trainer(strategy=strategy, devices=4, max_steps=4)
trainer.fit(LitModel(), data, ckpt_path="last.ckpt")  # resume: each rank reads its own bytes
plain = LitModel()  # the plain LightningModule (no strategy: nothing sharded), one process
plain.load_state_dict(sg.load_file("last.ckpt/model.safetensors"))
# --- end of the block ---
ok = same(plain.state_dict(), sg.full_state_dict(lit_module, rank0_only=False))

# --- README block: async saves with Lightning, verbatim ---
import lightning as L

import shardgather as sg


class SaveEvery(L.Callback):  # saves that training does not wait for
    def __init__(self, n):
        self.n, self.handle = n, None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step % self.n == 0:
            optimizer = trainer.optimizers[0]
            self.handle = sg.save_checkpoint(
                f"ckpt/{trainer.global_step}", module, optimizer, blocking=False
            )  # waits for the previous one first

    def on_train_end(self, trainer, module):
        if self.handle is not None:
            self.handle.wait()


# Or shardgather's strategy with Lightning's own switch: ModelCheckpoint as usual
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from shardgather.integrations.lightning import ModelParallelStrategy

strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
checkpoints = ModelCheckpoint(every_n_train_steps=1000, save_top_k=-1)  # -1: keep every one
trainer = L.Trainer(
    strategy=strategy, devices=4, max_epochs=1, plugins=[AsyncCheckpointIO()], callbacks=[checkpoints]
)
# --- end of the block ---

trainer.fit(LitModel(), data)
trainer.save_checkpoint("async.ckpt")  # after fit: written at once (no run to finish it)
strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
trainer = L.Trainer(strategy=strategy, devices=4, max_steps=2, callbacks=[SaveEvery(1)])
trainer.fit(LitModel(), data)
ok = ok and sorted(os.listdir("ckpt")) == ["1", "2"]
ok = ok and os.path.isfile("async.ckpt/model.safetensors")
finish(ok, "lightning_trainer")
