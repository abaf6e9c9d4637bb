"""Whether the training loop holds a model's other outputs through the backward pass.

A Hugging Face model called with ``labels`` returns its loss beside its logits; the step
differentiates the loss alone (:mod:`chkpt_opt.graphs.tracer.step_outputs`). Whether the
logits are still alive while the backward runs depends on the loop, not on the model:

* ``model(**batch).loss.backward()`` and ``Trainer`` (whose ``compute_loss`` returns the
  loss alone) drop them when the forward returns;
* ``outputs = model(**batch); outputs.loss.backward()`` (Accelerate's examples) holds them
  until the backward returns.

The cost graph counts every output as held to the end of the step, a bound for both
loops. For a 4-layer Llama of width 256 on 8 x 241 tokens (vocabulary 2048) the logits
are 15.1 MiB, and a plan made at the peak of Hugging Face's checkpointing in a loop that
drops them left those bytes unused.

:func:`watch` looks at the start of each backward pass (a hook on the loss, which runs
before any other backward work) whether any tensor storage of the other outputs is still
referenced (a storage weak reference sees every tensor sharing it, views and
``detach()`` included), among the outputs that autograd does not keep for the backward
pass (those stay alive whatever the loop does). :func:`dropping_outputs` gives the graph of
a step whose outputs other than the loss are not held: its ``outputs`` are the
differentiated ones, so each other output's storage is freed after its last reader, as
PyTorch frees it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

from chkpt_opt.errors import InfeasibleBudgetError
from chkpt_opt.graphs.costgraph import CostGraph, storage_refs
from chkpt_opt.graphs.tracer.step_outputs import differentiated_positions, loss_position


def droppable(graph: CostGraph) -> bool:
    """Whether the step returns outputs it does not differentiate (logits beside a loss)."""
    chosen = graph.graph.get("grad_outputs")
    return chosen is not None and set(chosen) != set(graph.graph["outputs"])


def dropping_outputs(graph: CostGraph) -> CostGraph:
    """A copy of ``graph`` for a loop that drops the outputs it does not differentiate
    before the backward pass: only the differentiated ones are held to the end."""
    if not droppable(graph):
        raise ValueError(
            f"graph {graph.graph.get('name')!r} returns no outputs beside the ones its step "
            "differentiates; call dropping_outputs only where droppable(graph) is true."
        )
    copy = graph.copy()
    copy.graph = dict(graph.graph)
    copy.graph["outputs"] = list(graph.graph["grad_outputs"])
    del copy.graph["grad_outputs"]
    return copy


def watched_positions(graph: CostGraph, module: torch.fx.GraphModule) -> tuple[int, ...]:
    """The flat output positions of ``module`` (a capture whose cost graph is ``graph``)
    that tell whether the loop holds the outputs: those the step does not differentiate
    and autograd does not keep. An output saved for the backward pass (T5's encoder
    states, read by every cross-attention) stays alive whatever the loop does."""
    if not droppable(graph):
        return ()
    output = next(n for n in module.graph.nodes if n.op == "output")
    flat = tree_flatten((output.args, output.kwargs))[0]
    chosen = set(graph.graph["grad_outputs"])
    saved = {sid for _, attrs in graph.nodes(data=True) for sid in attrs["saved"]}
    return tuple(
        i
        for i, arg in enumerate(flat)
        if isinstance(arg, torch.fx.Node)
        and arg.name in graph
        and arg.name not in chosen
        and not set(storage_refs(graph, arg.name)) & saved
    )


def watch(out: Any, positions: tuple[int, ...], observe: Callable[[bool], None]) -> None:
    """Calls ``observe(held)`` once, at the start of the backward pass of the loss in
    ``out`` (a model's outputs), with whether any storage of its tensors at the flat
    ``positions`` (:func:`watched_positions`) is still referenced then. Does nothing where
    ``out`` carries no loss, or no tensor there."""
    leaves, spec = tree_flatten(out)
    position = loss_position(spec)
    if position is None or differentiated_positions(leaves, spec) != [position]:
        return
    loss = leaves[position]
    loss_storage = StorageWeakRef(loss.untyped_storage())
    others = [
        StorageWeakRef(leaves[i].untyped_storage())
        for i in positions
        if i < len(leaves) and i != position and isinstance(leaves[i], torch.Tensor)
    ]
    others = [ref for ref in others if ref != loss_storage]
    if not others:
        return
    seen = False

    def at_backward(grad: torch.Tensor) -> None:
        nonlocal seen
        if not seen:
            seen = True
            observe(any(not ref.expired() for ref in others))

    loss.register_hook(at_backward)


@contextlib.contextmanager
def outputs_held_hint(counted_held: bool) -> Iterator[None]:
    """Where ``counted_held`` (the plan counts the outputs beside the loss held, and the
    loop may drop them), an :class:`InfeasibleBudgetError` raised inside says what a loop
    that drops them can do: pass ``outputs_held=False``, and their bytes are the plan's."""
    try:
        yield
    except InfeasibleBudgetError as err:
        if not counted_held:
            raise
        message = (
            f"{err} This plan counts the model's outputs beside the loss (the logits) as "
            "held through the backward pass, as a loop that keeps them does; if your loop "
            "drops them first (`loss = model(**batch).loss`, as Trainer does), pass "
            "chkpt_opt.optimize(..., outputs_held=False) and their bytes are free for the plan."
        )
        raise InfeasibleBudgetError(
            message,
            budget_bytes=err.budget_bytes,
            min_feasible_bytes=err.min_feasible_bytes,
            exact=err.exact,
        ) from err
