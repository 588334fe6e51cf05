"""Small models with the features that trip gatherers: tied weights, uneven and
empty shards, persistent/non-persistent buffers, int64 buffers, a frozen bf16 param."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, frozen_bf16: bool = False, hidden: int | None = None) -> None:
        super().__init__()
        hidden = hidden or 3 * d + 1
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        # A parameter whose dim 0 (1) is smaller than any world size > 1: empty shards.
        self.gain = nn.Parameter(torch.randn(1, d))
        if frozen_bf16:
            self.gate = nn.Parameter(torch.randn(5, d).to(torch.bfloat16), requires_grad=False)
        else:
            self.gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(torch.relu(self.fc1(self.ln(x)))) * self.gain
        if self.gate is not None:
            h = h + self.gate.float().sum(0)
        return x + h


class TinyLM(nn.Module):
    def __init__(
        self,
        vocab: int = 37,
        d: int = 12,
        n_layers: int = 3,
        tied: bool = True,
        frozen_bf16: bool = False,
        hidden: int | None = None,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d, frozen_bf16, hidden) for _ in range(n_layers)])
        self.norm = nn.LayerNorm(d)
        self.bn = nn.BatchNorm1d(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5))
        self.register_buffer("cache", torch.zeros(3), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx) * self.scale
        for b in self.blocks:
            h = b(h)
        h = self.bn(self.norm(h).transpose(1, 2)).transpose(1, 2)
        return self.lm_head(h)


class ConvNet(nn.Module):
    """A channels_last conv weight: FSDP1 flattens it in memory order."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3)
        self.conv.weight.data = self.conv.weight.data.to(memory_format=torch.channels_last)
        self.head = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).mean((2, 3)))


def batch(rank: int, step: int, vocab: int = 37) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (4, 6), generator=g)


def train_steps(
    model: nn.Module, rank: int, steps: int, opt: torch.optim.Optimizer, start: int = 0
) -> float:
    loss = torch.tensor(0.0)
    for s in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        loss = model(batch(rank, s)).float().pow(2).mean()
        loss.backward()
        opt.step()
    return float(loss.detach())


def make_optimizer(model: nn.Module, name: str = "adamw") -> torch.optim.Optimizer:
    """Two param groups with different learning rates: the blocks, and the rest."""
    from shardgather import clean_fqn

    blocks, rest = [], []
    for n, p in model.named_parameters():
        (blocks if clean_fqn(n).startswith("blocks.") else rest).append(p)
    groups = [{"params": blocks, "lr": 1e-2}, {"params": rest, "lr": 5e-3}]
    groups = [g for g in groups if g["params"]]
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)
    if name == "adam":
        return torch.optim.Adam(groups, lr=1e-2)
    return torch.optim.SGD(groups, lr=1e-2, momentum=0.9)


class Experts(nn.Module):
    """Expert weights as 3-D tensors ``[experts, d, h]`` (torchtitan's layout, so expert
    parallelism shards dim 0)."""

    def __init__(self, d: int, h: int, experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, d, h) / d**0.5)
        self.w2 = nn.Parameter(torch.randn(experts, h, d) / h**0.5)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        w1, w2 = self.w1, self.w2
        if hasattr(w1, "to_local"):  # expert parallel: the experts this rank holds
            w1, w2 = w1.to_local(), w2.to_local()
        gate = gate[..., : w1.shape[0]]
        h = torch.einsum("btd,edh->beth", x, w1).relu()
        y = torch.einsum("beth,ehd->betd", h, w2)
        return (y * gate.permute(0, 2, 1).unsqueeze(-1)).sum(1)


class MoE(nn.Module):
    """A router, experts and a shared dense layer. The forward runs the experts this
    rank holds on every token, weighted by the router: not a real dispatch, but every
    weight gets a gradient."""

    def __init__(self, d: int = 12, h: int = 10, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = Experts(d, h, experts)
        self.shared = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.softmax(self.router(x), -1)
        return self.shared(x) + self.experts(x, gate)


class MoELM(nn.Module):
    def __init__(self, vocab: int = 37, d: int = 12, n_layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([MoE(d) for _ in range(n_layers)])
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for b in self.blocks:
            h = h + b(h)
        return self.lm_head(h)
