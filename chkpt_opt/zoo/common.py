"""What every zoo family shares: the ``Built`` triple, moving it to a device, and parameter
counts."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

Built = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]
"""``(model, example_args, example_kwargs)``, what every builder returns."""


def n_params(model: nn.Module) -> int:
    """Number of parameters."""
    return sum(p.numel() for p in model.parameters())


def param_mib(model: nn.Module) -> float:
    """Parameter memory in MiB."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20


def on_device(built: Built, device: str | torch.device) -> Built:
    """``built`` with its model and every tensor input moved to ``device``."""
    model, args, kwargs = built
    move = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
    return model.to(device), tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}
