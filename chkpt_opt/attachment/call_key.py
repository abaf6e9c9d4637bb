"""What a training call is keyed by: its inputs' structure, shapes and dtypes, the model's
precision, autocast, and whether the parameters' gradients are alive at the call
(:mod:`chkpt_opt.attachment.step_state`).

A captured graph is exact for one key: torch.export bakes shapes, constants, the
parameters' dtype and the autocast state into it. Two keys of one *family* differ only in
their tensors' shapes, so a schedule made for one maps onto the other by node names (the
same program, other sizes) and is checked there by the simulator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from chkpt_opt.attachment.step_state import gradients_held
from chkpt_opt.graphs.tracer.dynamic_dims import leaf_path

_CONSTANTS = (bool, int, float, str, type(None), torch.dtype, torch.device)
_AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class TensorLeaf:
    """A tensor input: where it sits in the call, and what the graph depends on."""

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    requires_grad: bool


@dataclass(frozen=True)
class ConstantLeaf:
    """A non-tensor input, which the capture bakes in as a constant."""

    path: str
    value: object


@dataclass(frozen=True)
class CallKey:
    """The key of one capture.

    Attributes:
        leaves: every input leaf, keyword inputs sorted by name.
        weights: the dtype and device of the model's first floating-point parameter, and
            how many parameters require gradients.
        autocast: for CPU and CUDA, whether autocast is on and its dtype.
        grads_held: whether the parameters' gradients are alive at the call (gradient
            accumulation), which the step's memory counts from its start.
    """

    leaves: tuple[TensorLeaf | ConstantLeaf, ...]
    weights: tuple[object, ...]
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    grads_held: bool = False

    @property
    def family(self) -> tuple[object, ...]:
        """The key without tensor shapes: calls of one family run one program."""
        leaves = tuple(
            (leaf.path, leaf.dtype, leaf.device, len(leaf.shape), leaf.requires_grad)
            if isinstance(leaf, TensorLeaf)
            else leaf
            for leaf in self.leaves
        )
        return (leaves, self.weights, self.autocast, self.grads_held)

    @property
    def input_elements(self) -> int:
        """Elements in all tensor inputs: how large a call of its family this is."""
        return sum(math.prod(leaf.shape) for leaf in self.leaves if isinstance(leaf, TensorLeaf))

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The tensor inputs' shapes by input path."""
        return {leaf.path: leaf.shape for leaf in self.leaves if isinstance(leaf, TensorLeaf)}

    def describe(self) -> str:
        """The tensor inputs' shapes and the precision, for logs: ``input_ids[4, 256] ...``."""
        shapes = " ".join(
            f"{leaf.path}{list(leaf.shape)}" for leaf in self.leaves if isinstance(leaf, TensorLeaf)
        )
        on = [f"{device} {dtype}" for device, enabled, dtype in self.autocast if enabled]
        held = " with gradients held" if self.grads_held else ""
        return shapes + (f" under autocast ({', '.join(on)})" if on else "") + held


def call_key(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallKey:
    """The key of ``model(*args, **kwargs)`` in the current autocast state.

    Raises:
        TypeError: an input that is neither a tensor, a plain constant, nor a tuple, list
            or dict of them (such a call cannot be captured).
    """
    ordered = {name: kwargs[name] for name in sorted(kwargs)}
    flat, _ = pytree.tree_flatten_with_path((args, ordered))
    leaves: list[TensorLeaf | ConstantLeaf] = []
    for path, value in flat:
        where = leaf_path(path)
        if isinstance(value, torch.Tensor):
            leaves.append(
                TensorLeaf(
                    where,
                    tuple(value.shape),
                    value.dtype,
                    str(value.device),
                    value.requires_grad,
                )
            )
        elif isinstance(value, _CONSTANTS):
            leaves.append(ConstantLeaf(where, value))
        else:
            raise TypeError(
                f"input {where} is a {type(value).__qualname__}; chkpt_opt captures calls whose "
                "inputs are tensors, plain constants, or tuples, lists and dicts of them. Pass "
                "it as tensors, or call chkpt_opt.detach(model) to train without the plan."
            )
    return CallKey(tuple(leaves), _weights(model), _autocast_state(), gradients_held(model))


def _weights(model: torch.nn.Module) -> tuple[object, ...]:
    first = next((p for p in model.parameters() if p.is_floating_point()), None)
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    if first is None:
        return (None, None, trainable)
    return (first.dtype, str(first.device), trainable)


def _autocast_state() -> tuple[tuple[str, bool, torch.dtype], ...]:
    return tuple(
        (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        for device in _AUTOCAST_DEVICES
    )
