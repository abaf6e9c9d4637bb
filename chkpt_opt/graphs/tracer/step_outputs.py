"""Which outputs of a model a training step differentiates: the one rule that the tracer
(which outputs receive a gradient in the cost graph) and :mod:`chkpt_opt.measurement.step`
(what a measured step backpropagates) share.

A model that returns a mapping with a ``loss`` entry (a Hugging Face ``ModelOutput``, a
dict) is trained on that loss alone: ``model(**batch).loss.backward()``, as Hugging Face's
``Trainer`` and every loop of its documentation do. The other entries (``logits``, hidden
states) receive no gradient; the caller may still hold them through the backward call (a
loop that keeps ``outputs`` does), which is how the op sequence counts them (outputs live
to the end of the step). Any other output (a tensor, a tuple) has every floating-point
tensor that requires grad differentiated, seeded with ones: for a scalar loss that is
``loss.backward()``.

Before this rule the tracer seeded a gradient of ones into the logits of a Hugging Face
model called with ``labels`` and counted the logits' gradient and its backward through the
LM head: a 4-layer Llama of width 256 on 4 x 256 tokens (vocabulary 2048) was predicted at
151.2 MiB where ``loss.backward()`` with the outputs held measures 143.2 MiB.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_flatten

LOSS_KEY = "loss"


def loss_position(spec: TreeSpec) -> int | None:
    """The flat leaf position of the ``loss`` entry of an output with pytree ``spec``, if
    the output is a mapping that has one as a single leaf; None otherwise."""
    if not isinstance(spec.type, type) or not issubclass(spec.type, Mapping):
        return None
    keys = list(spec.context) if isinstance(spec.context, (list, tuple)) else None
    if keys is None or LOSS_KEY not in keys or len(keys) != spec.num_children:
        return None
    offset = 0
    for key, child in zip(keys, spec.children()):
        if key == LOSS_KEY:
            return offset if child.num_leaves == 1 else None
        offset += child.num_leaves
    return None


def differentiated_positions(leaves: list[Any], spec: TreeSpec) -> list[int]:
    """Positions of the flat output ``leaves`` (flattened with ``spec``) that the step
    differentiates: the loss alone where the output carries one that requires grad, every
    floating-point tensor that requires grad otherwise. ``leaves`` may be fake tensors."""
    position = loss_position(spec)
    if position is not None and position < len(leaves) and _differentiable(leaves[position]):
        return [position]
    return [i for i, leaf in enumerate(leaves) if _differentiable(leaf)]


def grad_outputs(out: Any) -> list[torch.Tensor]:
    """The tensors a training step on ``out`` (a model's outputs) backpropagates."""
    leaves, spec = tree_flatten(out)
    return [leaves[i] for i in differentiated_positions(leaves, spec)]


def _differentiable(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.dtype.is_floating_point
