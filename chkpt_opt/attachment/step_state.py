"""What the training step around a call holds besides its activations, observed at the call.

The budget holds for the step as the loop really runs it (see :mod:`chkpt_opt.step_budget`):

* **gradients held across micro-batches.** With gradient accumulation, the first
  micro-batch of an optimizer step starts without parameter gradients (after
  ``zero_grad(set_to_none=True)``) and every later one starts with all of them alive; with
  ``zero_grad(set_to_none=False)`` they are alive at every call. :func:`gradients_held`
  reads that off the parameters at each training call; it is part of the call's key
  (:class:`~chkpt_opt.attachment.call_key.CallKey`), so each state is planned once, on
  the graph whose op sequence says so
  (:func:`~chkpt_opt.memory_model.sequence.gradients.holding_parameter_gradients`). A loop
  that never accumulates never pays for it. Measured (nanoGPT-style GPT, 4 layers of
  width 128, AdamW, 2 micro-batches of 8 x 128 tokens, budget 25.9 MiB = per-block
  ``torch.utils.checkpoint``'s peak): planned for the first micro-batch alone, the second
  ran at 28.9 MiB.
* **autocast's weight cache.** Under ``torch.autocast`` with ``cache_enabled=True`` (the
  default) the low-precision copy of a parameter made by its first cast lives until
  autocast exits, where the op sequence frees it after its op (inside a recompute region)
  or after its op's backward. :func:`planned_autocast` runs the planned forward with the
  cache off: each use casts the parameter, as the cost graph counts it; the values are the
  same, so losses and gradients are bitwise the original's. Measured on the GPT above
  under bf16 autocast: 19.49 MiB with the cache against a 19.43 MiB budget, within it
  without.
* **optimizer state** appears at the first ``optimizer.step()``; the resident memory
  counts it from the first call (:func:`~chkpt_opt.step_budget.budget.static_memory`), so
  steps before it are below their prediction.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from chkpt_opt.attachment.held_batches import holding_batches
from chkpt_opt.attachment.held_outputs import dropping_outputs
from chkpt_opt.fx_attrs import fetch_attr
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.tracer import Traced
from chkpt_opt.memory_model.sequence.gradients import holding_parameter_gradients


def step_traced(
    traced: Traced, *, other_batch_bytes: int, drops_outputs: bool, grads_held: bool
) -> Traced:
    """``traced`` with its cost graph as the step runs the call: ``other_batch_bytes`` of
    other batches resident (:mod:`.held_batches`, :mod:`.fetched_batches`), the outputs
    beside the loss dropped before the backward pass where ``drops_outputs``
    (:mod:`.held_outputs`), every parameter gradient alive from the start where
    ``grads_held`` (the module docstring)."""
    graph = traced.graph
    if other_batch_bytes:
        graph = holding_batches(graph, other_batch_bytes)
    if drops_outputs:
        graph = dropping_outputs(graph)
    if grads_held:
        shared = shared_gradient_bytes(traced.captured.module, graph)
        graph = holding_parameter_gradients(graph, shared)
    return traced if graph is traced.graph else dataclasses.replace(traced, graph=graph)


def shared_gradient_bytes(module: torch.fx.GraphModule, graph: CostGraph) -> dict[str, int]:
    """For the ops of ``graph`` (the cost graph of the capture ``module``) whose backward
    creates first the gradient of a parameter that other ops read too (a tied embedding
    and LM head): the bytes of those gradients, which wait in autograd's input buffer for
    the other readers' (see
    :func:`~chkpt_opt.memory_model.sequence.gradients.holding_parameter_gradients`)."""
    readers: dict[int, list[str]] = {}
    sizes: dict[int, int] = {}
    for node in module.graph.nodes:
        if node.name not in graph or not graph.nodes[node.name]["has_backward"]:
            continue
        for param in _params_read(module, node):
            readers.setdefault(id(param), []).append(node.name)
            sizes[id(param)] = param.numel() * param.element_size()
    shared: dict[str, int] = {}
    for key, names in readers.items():
        if len(set(names)) > 1:  # the last reader's backward creates it first
            shared[names[-1]] = shared.get(names[-1], 0) + sizes[key]
    return shared


def _params_read(module: torch.fx.GraphModule, node: torch.fx.Node) -> list[torch.nn.Parameter]:
    """The trainable parameters an op reads (as the tracer finds them)."""
    if node.op == "call_module":
        params = module.get_submodule(str(node.target)).parameters()
        return [p for p in params if p.requires_grad]
    found = []
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            value = fetch_attr(module, str(arg.target))
            if isinstance(value, torch.nn.Parameter) and value.requires_grad:
                found.append(value)
    return found


def gradients_held(model: torch.nn.Module) -> bool:
    """Whether any trainable parameter of ``model`` has its gradient allocated now (at a
    training call: the backward pass will sum into it)."""
    return any(p.grad is not None for p in model.parameters() if p.requires_grad)


@contextlib.contextmanager
def planned_autocast() -> Iterator[None]:
    """Autocast's weight cache off for the span of the planned forward, where autocast is
    on (nothing changes otherwise). Checkpoint regions record this state and replay under
    it."""
    if not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")):
        yield
        return
    cached = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(cached)
