# ruff: noqa: E402
"""The README's first recipe, as pasted, on a tiny FSDP2 Llama (2 CPU processes):

    torchrun --standalone --nproc_per_node 2 examples/quickstart.py /tmp/sg-quickstart
"""

from _setup import finish, same, start, tiny_llama

rank = start()
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard

# --- your model, optimizer and files (here: tiny, made up on the spot) ---
model, config = tiny_llama()
plain_model, _ = tiny_llama(seed=1)
want = {k: v.clone() for k, v in model.state_dict().items()}
if rank == 0:
    model.save_pretrained("Llama-3-8B")  # a Hugging Face directory to load
    torch.save(want, "old.pt")
dcp.save(want, checkpoint_id="dcp_ckpt")
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

# --- README block: quickstart, verbatim ---
import torch
import torch.distributed as dist

import shardgather as sg

sd = sg.full_state_dict(model)  # every rank calls; rank 0 gets the dict ({} on the others)
sg.save_full_state_dict(model, "model.safetensors")  # streams; peak RAM ~ 2 buckets
sg.save_full_state_dict(model, "model-bf16.safetensors", dtype=torch.bfloat16)  # fused cast
sg.save_full_state_dict(model, "export/", files={"config.json": config.to_dict()})  # HF layout
sg.save_full_state_dict(model, "export/", max_shard_size="5GB", progress=True)  # bar on rank 0
sg.load_full_state_dict(model, "model.safetensors")  # each rank reads only its own bytes
sg.load_full_state_dict(model, "Llama-3-8B/")  # a save_pretrained directory (index + shards)
sg.load_full_state_dict(model.model, "export/", key_map={"model.": ""}, strict=False)  # a prefix
sg.load_full_state_dict(model, "dcp_ckpt/")  # a torch.distributed.checkpoint directory
sg.load_full_state_dict(model, "old.pt")  # torch files too (mmap'ed), or a dict
sg.load_full_state_dict(model, sd if dist.get_rank() == 0 else {})  # rank 0 sends the others
plain_model.load_state_dict(sg.load_file("model.safetensors"))  # tied weights restored

osd = sg.full_optim_state_dict(model, optimizer)  # keyed by the plain model's names
sg.load_full_optim_state_dict(model, optimizer, osd)  # any world size / FSDP flavour

sg.save_checkpoint("ckpt/step_1000", model, optimizer, extra={"step": 1000})  # atomic dir
handle = sg.save_checkpoint("ckpt/step_2000", model, optimizer, blocking=False)  # training goes on
handle.wait()  # on every rank: agreed, published
extra = sg.load_checkpoint("ckpt/step_1000", model, optimizer)  # or a plain model, 1 process
# (validated first; nothing unpickled: trust_pickle=True for extra holding arbitrary objects)
# --- end of the block ---

ok = extra == {"step": 1000} and same(plain_model.state_dict(), want)
if rank == 0:
    from transformers import LlamaForCausalLM

    ok = ok and same(sd, want)
    ok = ok and same(LlamaForCausalLM.from_pretrained("export").state_dict(), want)
ok = ok and same(sg.full_state_dict(model, rank0_only=False), want)
finish(ok, "quickstart")
