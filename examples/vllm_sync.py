# ruff: noqa: E402, B007
"""The README's vLLM recipe, as pasted: a policy trained with FSDP2 on 2 CPU processes
sends its weights after every step into a real vLLM engine — in a process of its own,
with vLLM's own torch (its venv: scripts/vllm_env.sh), receiving through vLLM's
weight-transfer API — first every rank's own pieces, then only what changed; the
engine's greedy generation then equals transformers' on the trainer's weights:

    torchrun --standalone --nproc_per_node 2 examples/vllm_sync.py /tmp/sg-vllm
"""

import json
import os
import subprocess
import sys

import torch

trainer_host, port, steps = "127.0.0.1", int(os.environ.get("SG_VLLM_PORT", "29527")), 3
PROMPT = [1, 2, 3, 4, 5]


def llama():  # type: ignore[no-untyped-def]
    """A tiny Llama vLLM's CPU attention takes (head_dim >= 32): your policy goes here."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    return LlamaForCausalLM(config).float()


if "--engine" in sys.argv:  # the inference side: vLLM's environment, a process of its own
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: a test
    model_dir, out = sys.argv[-2], sys.argv[-1]
    engine_options = {  # for this CPU test; yours: what your engine needs
        "skip_tokenizer_init": True,
        "kv_cache_memory_bytes": 64 << 20,
        "enforce_eager": True,
        "dtype": "float32",
        "max_model_len": 128,
    }
    # --- README block: vLLM engine, verbatim ---
    from vllm import LLM

    from shardgather.integrations import vllm as sg_vllm

    sg_vllm.register()  # the "shardgather" weight-transfer backend
    llm = LLM(model=model_dir, weight_transfer_config={"backend": "shardgather"}, **engine_options)
    init = {"host": trainer_host, "port": port, "trainers": 2}  # the trainer's ranks come first
    llm.collective_rpc("init_weight_transfer_engine", timeout=300, kwargs={"init_info": init})
    for step in range(steps):  # while every trainer rank calls sender.sync()
        llm.collective_rpc("start_weight_update", timeout=60)
        llm.collective_rpc("update_weights", timeout=600, kwargs={"update_info": {}})
        llm.collective_rpc("finish_weight_update", timeout=60)  # serves the new weights
    # --- end of the block ---
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], greedy, use_tqdm=False)
    with open(out, "w") as f:
        json.dump(list(got[0].outputs[0].token_ids), f)
    os._exit(0)  # vLLM's threads need no orderly shutdown here

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _setup import finish, start

rank = start()
from torch.distributed.fsdp import fully_shard

model = llama()  # your policy
engine = None
if rank == 0:  # the engine starts from the policy's checkpoint, in vLLM's own venv
    model.save_pretrained("engine-model")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    python = subprocess.run(
        ["bash", os.path.join(root, "scripts", "vllm_env.sh")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()[-1]
    env = dict(os.environ, PYTHONPATH=root)
    args = ["--engine", os.path.abspath("engine-model"), os.path.abspath("tokens.json")]
    engine = subprocess.Popen([python, os.path.abspath(__file__), *args], env=env)
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(rank))


def train_step(model):  # type: ignore[no-untyped-def]
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


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
    assert engine is not None
    try:
        ok = engine.wait(timeout=300) == 0
    finally:
        engine.kill()
    plain = llama().eval()  # transformers' greedy generation on the trainer's weights
    plain.load_state_dict({k: v.float() for k, v in want.items()})
    with torch.no_grad():
        ids = plain.generate(
            torch.tensor([PROMPT]), max_new_tokens=8, min_new_tokens=8, do_sample=False
        )
    with open("tokens.json") as f:
        ok = ok and json.load(f) == ids[0, len(PROMPT) :].tolist()
finish(ok, "vllm_sync")
