"""Other batches the training loop holds beside a call's own, observed when it is planned.

A loop may keep more than the batch it feeds the model alive through the step:
``Trainer`` with ``gradient_accumulation_steps`` fetches all of an optimizer step's
micro-batches before the first runs (``batch_samples``) and holds them, and the copy it
feeds to the model, to the step's end. They are memory of the step that the capture of one
call does not see. A batch fetched during the step (nanoGPT's ``train.py`` fetches the next
one between the forward and the backward pass) is not alive at the call, and not seen here:
:mod:`.fetched_batches` looks for it at the backward pass's start.
Measured (``tests/attachment/test_training_stacks.py``, ``Trainer`` with 2 micro-batches,
budget the per-block checkpointing peak in the same stack): 12.3 kB (GPT) and 5.3 kB
(Llama) over the budget while no plan counted them; within it since.

:func:`held_batch_bytes` sums, once per storage, the tensors alive at the call that look
like another batch of it: a plain tensor (not a parameter or a tensor subclass) on the
device, of the dtype, the number of dimensions and the first (batch) size of one of the
call's own tensor inputs, not requiring grad, and sharing no storage with the model's
parameters, buffers or gradients or with the call's own inputs. They are found in the
garbage collector's list of objects (a tensor held from C++ alone is not seen; the scan
takes about 0.1 s per million objects, once per plan). :func:`holding_batches` gives the
graph that counts them among its inputs, so that every plan (the resident memory, the
predicted step peak, the summary) counts them resident.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from chkpt_opt.graphs.costgraph import CostGraph


def held_batch_bytes(model: torch.nn.Module, call_inputs: Iterable[Any]) -> int:
    """Bytes of the tensors alive now that look like another batch of a call to ``model``
    with ``call_inputs`` (its positional and keyword values; see the module docstring)."""
    own = [v for v in tree_flatten(list(call_inputs))[0] if isinstance(v, torch.Tensor)]
    looks = {(t.dtype, t.device, t.dim(), t.shape[0]) for t in own if t.dim() > 0}
    if not looks:
        return 0
    known = {storage_ptr(t) for t in own} | model_storages(model)
    held: dict[int, int] = {}
    for obj in gc.get_objects():
        if type(obj) is not torch.Tensor or obj.requires_grad or obj.dim() == 0:
            continue
        if (obj.dtype, obj.device, obj.dim(), obj.shape[0]) not in looks:
            continue
        ptr = storage_ptr(obj)
        if ptr and ptr not in known:
            held[ptr] = obj.untyped_storage().nbytes()
    return sum(held.values())


def holding_batches(graph: CostGraph, nbytes: int) -> CostGraph:
    """``graph``, or a copy that counts ``nbytes`` of other batches held beside its inputs
    (``graph.graph["held_batch_bytes"]``, added to its ``input_bytes``)."""
    if nbytes <= 0:
        return graph
    copy = graph.copy()
    copy.graph = dict(graph.graph)
    copy.graph["input_bytes"] = int(graph.graph["input_bytes"]) + nbytes
    copy.graph["held_batch_bytes"] = nbytes
    return copy


def model_storages(model: torch.nn.Module) -> set[int]:
    """The storage addresses of ``model``'s parameters, buffers and gradients now."""
    known = set()
    for tensor in (*model.parameters(), *model.buffers()):
        known.add(storage_ptr(tensor))
        if tensor.grad is not None:
            known.add(storage_ptr(tensor.grad))
    return known


def storage_ptr(tensor: torch.Tensor) -> int:
    """The address of a tensor's storage (0 where it has none, as a fake tensor)."""
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0
