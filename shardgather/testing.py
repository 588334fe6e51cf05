"""Models for benchmarks and memory tests: a GPT-like stack of realistic shapes.

Public so that users can reproduce the numbers in bench/ on their own machines.
"""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(self.qkv(self.ln1(x))[..., : x.shape[-1]])
        return x + self.fc2(torch.relu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for b in self.blocks:
            h = b(h)
        return self.lm_head(self.norm(h))


def build_gpt(size_gb: float, device: torch.device | str = "cpu", width: int | None = None) -> GPT:
    """A tied-embedding GPT of about ``size_gb`` GiB of fp32 parameters, seeded.
    ``width``: the model dimension (default 1024, 2048 from 2 GiB); a narrow one gives
    many small parameters for the size."""
    device = torch.device(device)
    d = width or (1024 if size_gb < 2 else 2048)
    vocab = 32000
    per_layer = 12 * d * d + 13 * d
    layers = max(1, round((size_gb * 2**30 / 4 - vocab * d) / per_layer))
    with torch.device("meta"):
        model = GPT(vocab, d, layers)
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=g)
    model.lm_head.weight = model.embed.weight
    return model


def parallelize_gpt(model: GPT, mesh: torch.distributed.device_mesh.DeviceMesh) -> GPT:
    """Lay ``model`` out 2-D on ``mesh`` (dims ``("dp", "tp")``), as Megatron-style tensor
    parallelism under FSDP2 does: ``qkv``/``fc1`` column-wise and ``proj``/``fc2`` row-wise
    over ``tp``, then FSDP2 over ``dp`` (each block, then the root). The tied embedding
    stays whole across ``tp`` (sharded over ``dp`` only). For benchmarks and memory tests:
    the forward is not a tensor-parallel one."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {"qkv": ColwiseParallel(), "proj": RowwiseParallel()}
    plan |= {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    for b in model.blocks:
        parallelize_module(b, mesh["tp"], plan)
        fully_shard(b, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model
