"""The part of the op sequence that no schedule changes: the gradients of the backward pass.

Every form of schedule lowers to an op sequence whose backward steps run in the reverse
order of the forward ops (:func:`chkpt_opt.memory_model.op_sequence.lower` for regions, cached and
unpacked ops; :func:`chkpt_opt.memory_model.staged.sequence.lower_staged` for staged recomputation).
What a schedule changes is where the recomputations go between those steps; the gradients
each backward step creates, sums and frees are the same. The rules (those of
:mod:`chkpt_opt.memory_model.op_sequence`):

* the gradient of an op's output is created by the backward of its last reader (or at the
  start of the backward pass for a step output the step differentiates) and freed once the
  op's own backward has run; views pass gradients on without copying; a parameter
  gradient lives to the end of the step;
* a second gradient for a tensor is summed into the first once the backward that made it
  has released its inputs, out of place (old, new and sum alive together) where the two
  buffers cannot be reused; fresh gradients of one backward call are summed in place.

:func:`gradient_sums` says which backward steps are followed by an ``"accumulate"`` step;
:func:`gradient_instances` adds the gradients' storages and every step's transient bytes
once the positions of all steps are known.

Parameter gradients alive from the start of the step (gradient accumulation: every
micro-batch after the first of an optimizer step, or ``zero_grad(set_to_none=False)``)
follow a rule of their own, written once in :func:`holding_parameter_gradients`: the
step holds them resident, and the gradient a backward step creates for a parameter is
summed into the held one in place by autograd (``AccumulateGrad``, which runs before the
next backward step) and freed, so it lives during that step only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from chkpt_opt.graphs.costgraph import CostGraph, edge_uses, grad_outputs

PARAM_GRADS_HELD = "param_grads_held"
"""Graph attribute: the parameters' gradients are alive from the start of the step
(:func:`holding_parameter_gradients`); the step's resident memory counts them
(:func:`chkpt_opt.step_budget.budget.graph_static_memory`)."""

GradientSum = tuple[str, bool, bool]
"""(input, summed in place, summed into a new buffer that replaces the caller's seed)."""


def holding_parameter_gradients(
    graph: CostGraph, shared_grad_bytes: Mapping[str, int] | None = None
) -> CostGraph:
    """A copy of ``graph`` for a step that starts with the parameters' gradients alive
    (the rule in the module docstring): each op's ``param_grad_bytes`` become bytes of its
    backward step alone (``bwd_workspace_bytes``, alive while that step runs and freed
    after it, as autograd frees the incoming gradient once summed into ``.grad``), and the
    graph says :data:`PARAM_GRADS_HELD`, so the resident memory counts the gradients for the
    whole step. The copy keeps node names, so a schedule of ``graph`` is one of the copy.

    ``shared_grad_bytes``: per op, the part of its ``param_grad_bytes`` that belongs to
    parameters other ops read too (a tied embedding and LM head). Autograd sums a
    parameter's gradients from all its readers in the input buffer of its one
    ``AccumulateGrad`` before adding them to ``.grad``, so the gradient the first of them
    creates waits there until the backward of the parameter's first reader, at the end of
    the backward pass for a tied embedding: that part stays a parameter gradient of the
    op, alive to the end of the step, as without gradients held.

    Measured (nanoGPT-style GPT with its tied embedding, 4 layers of width 128, 2
    micro-batches of 8 x 128 tokens per AdamW step, budget 25.9 MiB = per-block
    checkpoint's peak): planned as a first micro-batch, the second ran at 28.9 MiB; on
    this graph without ``shared_grad_bytes``, 0.25 MiB (the LM head's gradient) over its
    prediction; with them, within.
    """
    shared = shared_grad_bytes or {}
    copy = graph.copy()
    copy.graph = dict(graph.graph)
    copy.graph[PARAM_GRADS_HELD] = True
    for node, attrs in copy.nodes(data=True):
        created = int(attrs["param_grad_bytes"])
        kept = min(created, int(shared.get(node, 0)))
        if created > kept:
            attrs["bwd_workspace_bytes"] = int(attrs["bwd_workspace_bytes"]) + created - kept
            attrs["param_grad_bytes"] = kept
    return copy


def gradient_sums(
    graph: CostGraph,
    order: Sequence[str],
    nodes: Mapping[str, Mapping[str, Any]],
    preds: Mapping[str, Sequence[str]],
) -> dict[str, list[GradientSum]]:
    """For every op with a backward, the gradients its backward adds to existing ones (an
    ``"accumulate"`` step follows it where the list is not empty)."""
    accumulates: dict[str, list[GradientSum]] = {}
    has_grad = {o for o in grad_outputs(graph) if nodes[o]["has_backward"]}
    seeded = set(has_grad)  # outputs whose gradient is still the seed the caller holds
    for n in reversed(order):
        if not nodes[n]["has_backward"]:
            continue
        targets = [u for u in preds[n] if nodes[u]["requires_grad"]]
        # One incoming gradient per use; all but the first of a tensor without a gradient
        # yet are sums (a view's backward passes its gradient on instead, once).
        accumulates[n] = []
        for u in targets:
            uses = edge_uses(graph, u, n)
            alias = nodes[n]["bwd_grad_alias"]
            if alias and uses == 1:
                continue
            # A sum with an older gradient, or of views, is modelled out of place (it costs
            # one more gradient while it runs); fresh gradients of the same backward call
            # are summed in place into one of them.
            in_place = not alias
            if u in seeded:
                # The caller keeps its seed; autograd sums into the fresh incoming gradient,
                # which then stands as the output's gradient until its backward.
                accumulates[n].append((u, True, True))
                seeded.discard(u)
            elif u in has_grad:
                accumulates[n].append((u, False, False))
            accumulates[n] += [(u, in_place, False)] * (uses - 1)
        has_grad.update(targets)
    return accumulates


def gradient_instances(
    graph: CostGraph,
    nodes: Mapping[str, Mapping[str, Any]],
    preds: Mapping[str, Sequence[str]],
    kinds: Sequence[tuple[str, str, int]],
    accumulates: Mapping[str, list[GradientSum]],
    acc_pos: Mapping[str, int],
    start_pos: int,
    alloc_at: dict[str, tuple[int, int]],
    hold: Callable[[str, int], None],
) -> list[int]:
    """Adds the gradient storages (``g:``, ``p:`` instances) to ``alloc_at`` and their
    releases through ``hold``, and returns every step's transient bytes (workspaces and
    out-of-place sums). ``kinds`` are the steps ``(kind, op, region)`` in order,
    ``start_pos`` the position of the ``"bwd_start"`` step."""
    end = len(kinds)
    bwd_pos = {n: p for p, (kind, n, _) in enumerate(kinds) if kind == "bwd"}

    def kept_until(node: str) -> int:
        return bwd_pos.get(node, end)

    transient = [0] * end
    grads: dict[str, list[str]] = {}
    outputs_with_grad = [o for o in grad_outputs(graph) if nodes[o]["has_backward"]]
    for out in sorted(set(outputs_with_grad), key=lambda o: nodes[o]["index"]):
        inst = f"g:{out}"
        alloc_at[inst] = (start_pos, nodes[out]["grad_bytes"])
        grads[out] = [inst]
        hold(inst, end)  # the caller holds the output gradients through the backward call
    for position, (kind, n, _) in enumerate(kinds):
        if kind in ("fwd", "recompute"):
            transient[position] = nodes[n]["fwd_workspace_bytes"]
            continue
        if kind == "accumulate":
            transient[position] = sum(
                nodes[u]["grad_bytes"] for u, in_place, _ in accumulates[n] if not in_place
            )
            continue
        if kind != "bwd":
            continue
        attrs = nodes[n]
        for j, (u, _, into_seed) in enumerate(accumulates.get(n, ())):
            inst = f"g:{u}@{n}#{j}"  # an incoming gradient, summed into the existing one
            alloc_at[inst] = (position, nodes[u]["grad_bytes"])
            if into_seed:
                grads[u] = [inst]
                hold(inst, kept_until(u))
            else:
                hold(inst, acc_pos[n])
        for u in preds[n]:
            if not nodes[u]["requires_grad"] or grads.get(u):
                continue
            if attrs["bwd_grad_alias"]:
                grads[u] = list(grads.get(n, []))
            else:
                inst = f"g:{u}"
                alloc_at[inst] = (position, nodes[u]["grad_bytes"])
                grads[u] = [inst]
            for inst in grads[u]:
                hold(inst, kept_until(u))
        if attrs["param_grad_bytes"]:
            inst = f"p:{n}"
            alloc_at[inst] = (position, attrs["param_grad_bytes"])
            hold(inst, end)
        transient[position] = attrs["bwd_workspace_bytes"]
    return transient
