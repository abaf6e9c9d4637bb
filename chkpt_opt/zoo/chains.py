"""Chains: a homogeneous stack of linear layers, the simplest checkpointing problem."""

from __future__ import annotations

import torch
from torch import nn

from chkpt_opt.zoo.common import Built


class MLP(nn.Module):
    """A plain chain of linear layers (a homogeneous chain)."""

    def __init__(self, *, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).pow(2).mean()


def mlp(*, width: int = 256, depth: int = 16, batch: int = 64, seed: int = 0) -> Built:
    """A chain: ``depth`` linear+tanh layers."""
    torch.manual_seed(seed)
    return MLP(width=width, depth=depth).train(), (torch.randn(batch, width),), {}


class ReluChain(nn.Module):
    """``depth`` x (Linear + ReLU), the loss inside: a deep chain whose activations dwarf
    its parameters at a large batch (the multi-level checkpointing case)."""

    def __init__(self, *, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).pow(2).mean()


def relu_chain(*, width: int = 256, depth: int = 32, batch: int = 4096, seed: int = 0) -> Built:
    """A deep chain: ``depth`` linear+ReLU layers at batch ``batch``."""
    torch.manual_seed(seed)
    return ReluChain(width=width, depth=depth).train(), (torch.randn(batch, width),), {}
