"""Sizes rounded up, so a loop whose lengths creep upwards is planned once, not per length.

A loop that pads each batch to its longest sequence meets a new largest length now and
then (241, then 250, 253, 255 tokens in ``benchmarks/finetune.py``'s Llama run); each was
a full solve (about 25 s there). Where a family of calls is captured with symbolic sizes
and needs another plan (it grew past the first, or the first counted the logits held),
that plan is made at sizes rounded up to the next
bucket (:func:`bucket_size`: steps of an eighth of the size's power of two, so at most
12.5% above the call), on inputs grown to those sizes by repeating their last slice
(:func:`grown_inputs`: token ids, masks and labels keep their kinds of values); the one
graph then serves every call up to the bucket.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from chkpt_opt.graphs.tracer.dynamic_dims import InputDims, leaf_path

STEPS_PER_OCTAVE = 8
"""Buckets between two powers of two (241 -> 256, 257 -> 288, 8 -> 8, 9 -> 9)."""


def bucket_size(size: int) -> int:
    """``size`` rounded up to the next multiple of an eighth of its power of two."""
    if size <= STEPS_PER_OCTAVE:
        return size
    step = (1 << (size.bit_length() - 1)) // STEPS_PER_OCTAVE
    return -(-size // step) * step


def bucket_sizes(dims: InputDims) -> dict[str, int]:
    """Each symbol's bucket for the sizes ``dims`` was captured at, within its range."""
    out = {}
    for symbol, size in dims.example.items():
        high = dims.ranges[symbol][1]
        target = bucket_size(size)
        out[symbol] = target if high is None else min(target, high)
    return out


def grown_inputs(
    dims: InputDims, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """``(args, kwargs)`` with every symbolic dimension grown to its bucket by repeating
    the last slice along it; None where every size is already a bucket's."""
    targets = bucket_sizes(dims)
    if all(targets[s] == dims.example[s] for s in targets):
        return None
    flat, spec = pytree.tree_flatten_with_path((args, kwargs))
    values = []
    for path, value in flat:
        shape = dims.dims.get(leaf_path(path)) if isinstance(value, torch.Tensor) else None
        if shape is not None:
            grown = value.detach()
            for axis, dim in enumerate(shape):
                if isinstance(dim, str) and targets[dim] > grown.shape[axis]:
                    index = torch.arange(targets[dim], device=grown.device)
                    index = index.clamp(max=grown.shape[axis] - 1)
                    grown = grown.index_select(axis, index)
            value = grown.requires_grad_(value.requires_grad)
        values.append(value)
    new_args, new_kwargs = pytree.tree_unflatten(values, spec)
    return tuple(new_args), dict(new_kwargs)
