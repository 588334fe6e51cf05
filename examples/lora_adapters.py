# ruff: noqa: E402, F811
"""The README's LoRA recipes, as pasted: a LoRA adapter prepared by Accelerate (DDP on the
CPU; its FSDP plugin needs GPUs), one trained by the Hugging Face Trainer (Accelerate
underneath: DDP here too) and exported with its merged model, then one on a tiny FSDP2
Llama, exported in PEFT's own format and loaded back by PEFT (2 CPU processes):

    torchrun --standalone --nproc_per_node 2 examples/lora_adapters.py /tmp/sg-lora
"""

import os

from _setup import finish, same, start, tiny_llama

rank = start()
import torch


def build_model():  # type: ignore[no-untyped-def]
    return tiny_llama()[0]  # your model


def train(model, optimizer) -> None:  # type: ignore[no-untyped-def]
    batch = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


# What `accelerate launch --cpu` sets: without it Accelerate on a machine with no GPU
# runs every process alone (DistributedType.NO: no DDP, ranks training apart). On GPUs
# leave it out.
os.environ["ACCELERATE_USE_CPU"] = "1"

# --- README block: LoRA with Accelerate, verbatim ---
import torch
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model

import shardgather as sg

accelerator = Accelerator()
model = get_peft_model(build_model(), LoraConfig(r=8, target_modules="all-linear"))
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
model, optimizer = accelerator.prepare(model, optimizer)
train(model, optimizer)
sg.save_adapter(model, "adapter-accelerate")  # on every process
# --- end of the block ---

from peft import PeftModel, get_peft_model_state_dict

ok = accelerator.num_processes == 2  # really distributed (DDP)
if accelerator.is_main_process:
    unwrapped = accelerator.unwrap_model(model)
    loaded = PeftModel.from_pretrained(tiny_llama(seed=5)[0], "adapter-accelerate")
    ok = ok and same(get_peft_model_state_dict(loaded), get_peft_model_state_dict(unwrapped))

# The Trainer's data: a few token sequences (your dataset goes here).
data = [
    {"input_ids": ids, "labels": ids}
    for ids in torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(0))
]

# --- README block: LoRA with the Hugging Face Trainer, verbatim ---
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainingArguments

import shardgather as sg

model = get_peft_model(build_model(), LoraConfig(r=8, target_modules="all-linear"))
args = TrainingArguments("trainer-out", max_steps=2, save_strategy="no", report_to="none")
trainer = Trainer(model=model, args=args, train_dataset=data)
trainer.train()
sg.save_adapter(trainer.model_wrapped, "adapter-trainer")  # on every process
config = {"config.json": model.config.to_dict()}  # the merged model loads with from_pretrained
sg.save_full_state_dict(trainer.model_wrapped, "merged/", merge_adapter="default", files=config)
# --- end of the block ---

import copy

from transformers import LlamaForCausalLM

ok = ok and trainer.args.world_size == 2
if rank == 0:
    loaded = PeftModel.from_pretrained(tiny_llama(seed=5)[0], "adapter-trainer")
    ok = ok and same(get_peft_model_state_dict(loaded), get_peft_model_state_dict(trainer.model))
    merged_want = copy.deepcopy(trainer.model).merge_and_unload().state_dict()
    ok = ok and same(LlamaForCausalLM.from_pretrained("merged").state_dict(), merged_want)

# --- README block: LoRA under FSDP2, verbatim ---
import torch
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import fully_shard

import shardgather as sg

model = get_peft_model(build_model(), LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
for layer in model.base_model.model.model.layers:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
train(model, optimizer)
sg.save_adapter(model, "adapter")  # adapter_model.safetensors + adapter_config.json
sg.load_adapter(model, "adapter")  # each rank reads only its own elements
lora = sg.full_state_dict(model, keys="trainable")  # or names, "prefixes.", a predicate
# --- end of the block ---

names = sg.adapter_keys(model)
if rank == 0:
    loaded = PeftModel.from_pretrained(tiny_llama(seed=5)[0], "adapter")
    ok = ok and same(get_peft_model_state_dict(loaded), {names[k]: v for k, v in lora.items()})

finish(ok, "lora_adapters")
