# ruff: noqa: E402
"""The README's FSDP2 x tensor-parallel recipe, as pasted (4 CPU processes, dp 2 x tp 2):

    torchrun --standalone --nproc_per_node 4 examples/tensor_parallel.py /tmp/sg-tp
"""

from _setup import finish, same, start, tiny_llama

rank = start()
model, _ = tiny_llama()  # your model
want = {k: v.clone() for k, v in model.state_dict().items()}

# --- README block: FSDP2 x tensor parallel, verbatim ---
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import shardgather as sg

mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # "cuda" on GPUs
tp_plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
for layer in model.model.layers:  # a transformers Llama: its MLPs column/row-wise over tp
    parallelize_module(layer.mlp, mesh["tp"], tp_plan)
    fully_shard(layer, mesh=mesh["dp"])  # then FSDP2 over dp: (_StridedShard, Shard) blocks
fully_shard(model, mesh=mesh["dp"])
sg.save_full_state_dict(model, "export/")  # the plain model's names, bit-exact
sg.load_full_state_dict(model, "export/")  # each rank reads exactly its own blocks' bytes
# --- end of the block ---

placements = {str(p.placements) for p in model.parameters()}
ok = "(_StridedShard(dim=0, sf=2), Shard(dim=0))" in placements
ok = ok and same(sg.full_state_dict(model, rank0_only=False), want)
if rank == 0:
    ok = ok and same(sg.load_file("export/model.safetensors"), want)
finish(ok, "tensor_parallel")
