"""Griewank's binomial checkpointing (Revolve) on homogeneous chains, as a reference bound.

Revolve (Griewank 1992; Griewank & Walther 2000, "Algorithm 799") reverses a chain of ``l``
identical steps holding at most ``s`` checkpoints (snapshot slots, the initial state in one of
them) besides the current state. Its optimal schedules are *multi-level*: a checkpoint is
taken inside a stretch that is itself being recomputed, so a step may be evaluated several
times (at most the *repetition number* ``r``, the least ``r`` with ``C(s + r, s) >= l``; a
keep-set schedule evaluates every step at most twice, ``r <= 2``). The
least number of forward step evaluations of the whole reversal is

    t(l, s) = r * l - C(s + r, r - 1)

(the last step of each reversal is fused with its adjoint and not counted; ``t(l, 1) = l (l -
1) / 2``, ``t(l, s) = l - 1`` once ``s >= l - 1``). :func:`revolve_forward_steps` evaluates it
and :func:`revolve_forward_steps_recursive` checks it by the recursion over where the first
checkpoint goes: ``t(l, s) = min_j [j + t(l - j, s - 1) + t(j, s)]``.

This is **not a registered solver**: such schedules need nested recompute regions, which the
keep-set schedule model of :mod:`chkpt_opt.memory_model.schedule` does not have yet (see the
design's "Schedule" contract). :func:`revolve_reference` puts Revolve's extra compute next to the
optimum of our single-level model (``dp_chain``) at matching memory, on a homogeneous chain
built by :func:`chkpt_opt.graphs.synthetic.chain_graph` (equal sizes and times, each op
saving its input). Memory is matched in states: Revolve with ``s`` slots holds at most
``s + 1`` states (the initial one included); our model, in the activation-only view of the
chain (gradient bytes set to zero, since Griewank counts states only), does not count the
graph input, which is resident, but holds the step output to the end: ``s + 1`` states of
``S`` bytes each, a budget of ``(s + 1) * S``. At keep-all both hold ``l`` states and
recompute nothing.

Measured on chains of 5 to 64 ops (every slot count): wherever a single level suffices
(``r <= 2``) the keep-set optimum equals Revolve's, and it is infeasible exactly where Revolve
needs ``r >= 3``: below that memory only nested schedules exist. That gap is what nested
regions would buy.

Example:
    >>> revolve_forward_steps(10, 3), revolve_forward_steps_recursive(10, 3)
    (15, 15)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from math import comb

from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes
from chkpt_opt.solvers.base import SolveStatus
from chkpt_opt.solvers.registry import get_solver


def repetition_number(n_steps: int, n_slots: int) -> int:
    """The least ``r`` with ``C(n_slots + r, n_slots) >= n_steps``: how many times Revolve's
    optimal schedules evaluate the most evaluated step (``r = 1``: no recomputation)."""
    _check(n_steps, n_slots)
    r = 0
    while comb(n_slots + r, n_slots) < n_steps:
        r += 1
    return r


def revolve_forward_steps(n_steps: int, n_slots: int) -> int:
    """Least number of forward step evaluations to reverse ``n_steps`` steps with ``n_slots``
    checkpoint slots (Griewank's binomial formula; see the module docstring).

    Raises:
        ValueError: unless ``n_steps >= 1`` and ``n_slots >= 1``.
    """
    r = repetition_number(n_steps, n_slots)
    if r == 0:
        return 0  # a single step: fused with its adjoint
    return r * n_steps - comb(n_slots + r, r - 1)


def revolve_forward_steps_recursive(n_steps: int, n_slots: int) -> int:
    """The same number by exhaustive recursion over the first checkpoint's position:
    advance ``j`` steps, store that state, reverse the last ``n_steps - j`` steps with one slot
    less, then the first ``j`` with all slots. Exponential without its cache; for tests.

    Raises:
        ValueError: unless ``n_steps >= 1`` and ``n_slots >= 1``.
    """
    _check(n_steps, n_slots)
    return _recursive(n_steps, n_slots)


@cache
def _recursive(steps: int, slots: int) -> int:
    if steps == 1:
        return 0
    if slots == 1:  # only the initial state: advance to the last step's input, every time
        return steps - 1 + _recursive(steps - 1, 1)
    return min(j + _recursive(steps - j, slots - 1) + _recursive(j, slots) for j in range(1, steps))


def _check(n_steps: int, n_slots: int) -> None:
    if n_steps < 1 or n_slots < 1:
        raise ValueError(
            f"Revolve needs at least one step and one slot, got n_steps={n_steps}, "
            f"n_slots={n_slots}."
        )


@dataclass(frozen=True)
class RevolveRow:
    """Revolve and the keep-set optimum at one memory size.

    Attributes:
        slots: Revolve's checkpoint slots ``s``.
        repetitions: Revolve's repetition number ``r``.
        revolve_extra_steps: forward steps Revolve recomputes beyond one forward pass
            (``t(l, s) + 1 - l``: the last step's forward, fused in ``t``, runs once too).
        revolve_extra_s: the same in seconds (steps times the op's forward time).
        budget_bytes: the matching activation budget ``(s + 1) * S`` of the activation-only
            view of the chain.
        dp_status: dp_chain's status at that budget (``optimal`` or ``infeasible``).
        dp_extra_s: dp_chain's recompute time there, or None when infeasible.
    """

    slots: int
    repetitions: int
    revolve_extra_steps: int
    revolve_extra_s: float
    budget_bytes: int
    dp_status: SolveStatus
    dp_extra_s: float | None


def homogeneous_chain(graph: CostGraph) -> tuple[int, int, float]:
    """``(ops, bytes per activation, seconds per op)`` of a homogeneous chain that saves inputs.

    Raises:
        ValueError: if ``graph`` is not such a chain (each op reading the one before, equal
            output sizes and forward times, each op but the first saving exactly its input).
    """
    order = ordered_nodes(graph)
    nodes = graph.nodes
    if not order:
        raise ValueError("the graph has no ops.")
    sizes = {nodes[v]["output_bytes"] for v in order}
    times = {nodes[v]["fwd_time_s"] for v in order}
    ok = len(sizes) == 1 and len(times) == 1 and graph.number_of_edges() == len(order) - 1
    for k, v in enumerate(order):
        preds = list(graph.predecessors(v))
        expected = [order[k - 1]] if k else []
        saved = set(nodes[v]["saved"])
        wants = set(nodes[order[k - 1]]["outputs"]) if k else set()
        ok = ok and preds == expected and saved == wants and nodes[v]["has_backward"]
    if not ok:
        raise ValueError(
            f"graph {graph.graph.get('name', '')!r} is not a homogeneous chain saving inputs; "
            "build one with chain_graph(length, activation_bytes=S, fwd_time_s=t)."
        )
    return len(order), sizes.pop(), float(times.pop())


def activation_view(graph: CostGraph) -> CostGraph:
    """A copy of ``graph`` with every gradient, parameter gradient and workspace at 0 bytes, so
    that the simulated peak counts forward activations only."""
    view = graph.copy()
    for v in view.nodes:
        attrs = view.nodes[v]
        attrs.update(grad_bytes=0, param_grad_bytes=0, fwd_workspace_bytes=0)
        attrs.update(bwd_workspace_bytes=0)
    return view


def revolve_reference(
    graph: CostGraph, slots: list[int] | None = None, *, time_limit_s: float | None = None
) -> list[RevolveRow]:
    """Revolve's extra compute next to dp_chain's optimum at matching memory.

    Args:
        graph: a homogeneous chain (see :func:`homogeneous_chain`).
        slots: Revolve slot counts to report (default ``1 .. l - 1``).
        time_limit_s: per dp_chain solve.

    Raises:
        ValueError: if ``graph`` is not a homogeneous chain saving inputs.
    """
    n_ops, size, op_s = homogeneous_chain(graph)
    view = activation_view(graph)
    solver = get_solver("dp_chain", require_complete=True)
    rows = []
    for s in slots if slots is not None else range(1, max(2, n_ops)):
        extra = revolve_forward_steps(n_ops, s) + 1 - n_ops
        budget = (s + 1) * size
        result = solver(view, budget, time_limit_s=time_limit_s)
        rows.append(
            RevolveRow(
                slots=s,
                repetitions=repetition_number(n_ops, s),
                revolve_extra_steps=extra,
                revolve_extra_s=extra * op_s,
                budget_bytes=budget,
                dp_status=result.status,
                dp_extra_s=result.objective if result.feasible else None,
            )
        )
    return rows
