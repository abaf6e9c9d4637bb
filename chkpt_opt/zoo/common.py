"""What every zoo family shares: the ``Built`` triple and parameter counts."""

from __future__ import annotations

from typing import Any

from torch import nn

Built = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]
"""``(model, example_args, example_kwargs)``, what every builder returns."""


def n_params(model: nn.Module) -> int:
    """Number of parameters."""
    return sum(p.numel() for p in model.parameters())


def param_mib(model: nn.Module) -> float:
    """Parameter memory in MiB."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
