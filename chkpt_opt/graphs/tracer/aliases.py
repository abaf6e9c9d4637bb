"""Inputs that share memory, captured as separate inputs."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree


def separate_aliases(
    args: tuple[Any, ...], kwargs: dict[str, Any], model: torch.nn.Module | None = None
) -> tuple[tuple[Any, ...], dict[str, Any], list[str]]:
    """Copies every tensor input that shares memory with an earlier input (or with a
    parameter or buffer of ``model``), so a capture sees distinct inputs.

    torch.export merges inputs that alias each other: planned on ``labels=input_ids``, the
    captured graph reads the tokens from ``labels`` and computes a wrong loss for any call
    whose labels differ. Returns the new ``(args, kwargs)`` and the copied inputs' paths.
    """
    seen: set[tuple[str, int] | None] = set()
    if model is not None:
        seen.update(_storage_of(t) for t in (*model.parameters(), *model.buffers()))
    copied: list[str] = []
    flat, spec = pytree.tree_flatten_with_path((args, kwargs))
    values = []
    for path, value in flat:
        storage = _storage_of(value) if isinstance(value, torch.Tensor) else None
        if storage is not None:
            if storage in seen:
                copied.append(describe_path(path))
                value = value.detach().clone().requires_grad_(value.requires_grad)
            else:
                seen.add(storage)
        values.append(value)
    new_args, new_kwargs = pytree.tree_unflatten(values, spec)
    return tuple(new_args), dict(new_kwargs), copied


def _storage_of(tensor: torch.Tensor) -> tuple[str, int] | None:
    """The device and address of a tensor's memory; None for one that has none (meta
    tensors, empty storages)."""
    if tensor.device.type == "meta":
        return None
    try:
        pointer = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # fake or functional tensors own no memory
        return None
    return (str(tensor.device), pointer) if pointer else None


def describe_path(path: tuple[Any, ...]) -> str:
    """Turns a pytree key path of ``(args, kwargs)`` into ``example_inputs[1]['x']``-style text."""
    if not path:
        return "an input"
    head, *rest = path
    base = "example_inputs" if getattr(head, "idx", None) == 0 else "example_kwargs"
    return base + "".join(str(k) for k in rest)
