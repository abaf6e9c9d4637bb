"""The whole training step around the solvers, for researchers working on cost graphs: the
resident memory of a step for an optimizer (a name or a torch.optim instance), the one split
of a step budget, results that carry the whole step's figures beside the activation bytes
that solvers and the simulator count (:func:`solve`, :func:`simulate_step`), and the error
that names the smallest step budget where a budget cannot be met
(:func:`unmet_budget_error`, raised by ``plan`` and ``Plan.for_compile``).

Units: a solver (``get_solver(name)(graph, bytes)``) takes and reports activation bytes, the
bytes created during the forward and backward passes, which is what
``simulate(graph, schedule).peak_bytes`` reports. :func:`solve` takes the budget of the
whole training step; its result carries the activation figures under the same names
(``peak_bytes``, ``budget_bytes``) and the whole-step figures beside them
(``step_budget_bytes``, ``resident_bytes``, ``step_peak_bytes``), as does
:func:`simulate_step`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from chkpt_opt.errors import BudgetError, InfeasibleBudgetError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.sequence.gradients import PARAM_GRADS_HELD
from chkpt_opt.memory_model.simulate import MemoryProfile, simulate
from chkpt_opt.solvers import SolveResult, get_solver, smallest_peak
from chkpt_opt.step_budget.budget import (
    Budget,
    OptimizerSpec,
    StaticMemory,
    format_bytes,
    format_bytes_pair,
    graph_static_memory,
    optimizer_spec,
    parse_budget,
    split_budget,
    static_memory,
)
from chkpt_opt.step_budget.sharding import Sharding, per_rank_graph, rank_static_memory

OptimizerArg = str | torch.optim.Optimizer | None


def _spec_of(optimizer: OptimizerArg) -> tuple[OptimizerSpec | None, bool | None]:
    """The optimizer spec and ``foreach`` setting of a name or an optimizer instance."""
    if optimizer is None or isinstance(optimizer, str):
        return optimizer_spec(optimizer), None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise BudgetError(
            f"optimizer {optimizer!r} is neither a name, None, nor a torch.optim.Optimizer."
        )
    defaults = optimizer.defaults
    foreach = defaults.get("foreach")
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        name = "adamw_amsgrad" if defaults.get("amsgrad") else "adamw"
    elif isinstance(optimizer, torch.optim.SGD):
        name = "sgd_momentum" if defaults.get("momentum", 0) else "sgd"
    elif isinstance(optimizer, torch.optim.RMSprop):
        name = "rmsprop"
    elif isinstance(optimizer, torch.optim.Adagrad):
        name = "adagrad"
    else:
        raise BudgetError(
            f"chkpt_opt does not know the state size of {type(optimizer).__name__}; pass one of "
            "the optimizer names ('adamw', 'adam', 'sgd', 'sgd_momentum', 'rmsprop', 'adagrad') "
            "that matches it, or optimizer=None and leave room for its state in the budget."
        )
    return optimizer_spec(name), foreach


def static_memory_for(
    graph: CostGraph, optimizer: OptimizerArg = "adamw", *, sharding: Sharding | None = None
) -> StaticMemory:
    """The resident memory of a training step of ``graph`` with ``optimizer``, on one rank
    of ``sharding`` where given (:func:`chkpt_opt.step_budget.sharding.rank_static_memory`).

    A named optimizer is assumed to train every trainable parameter; an optimizer instance
    is sized by the parameters of its own parameter groups.
    """
    spec, foreach = _spec_of(optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer):
        if sharding is not None:
            return rank_static_memory(graph, sharding, spec, foreach=foreach)
        return graph_static_memory(graph.graph, spec, foreach=foreach)
    params = {
        id(p): p for group in optimizer.param_groups for p in group["params"] if p.requires_grad
    }.values()  # frozen parameters get no gradient, hence no state
    sizes = [p.numel() * p.element_size() for p in params]
    g = graph.graph
    if sharding is not None:
        return rank_static_memory(
            graph,
            sharding,
            spec,
            foreach=foreach,
            trainable_param_bytes=sum(sizes),
            n_trainable_tensors=len(sizes),
            largest_param_bytes=max(sizes, default=0),
        )
    device = str(g.get("device_type", "cpu"))
    static = static_memory(
        param_bytes=g["param_bytes"],
        trainable_param_bytes=sum(sizes),
        buffer_bytes=g["buffer_bytes"],
        input_bytes=g["input_bytes"],
        n_trainable_tensors=len(sizes),
        largest_param_bytes=max(sizes, default=0) or None,
        optimizer=spec,
        foreach=device in ("cuda", "meta") if foreach is None else foreach,
    )
    grads = int(g["trainable_param_bytes"])
    held = grads if g.get(PARAM_GRADS_HELD) else 0
    return dataclasses.replace(static, grad_bytes=grads, resident_grad_bytes=held)


def _device_total_bytes(graph: CostGraph) -> int | None:
    if graph.graph.get("device_type") == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return None


def activation_budget(
    graph: CostGraph,
    budget: int | str | Budget,
    *,
    optimizer: OptimizerArg = "adamw",
    sharding: Sharding | None = None,
) -> tuple[Budget, StaticMemory, int]:
    """Parses a step budget (per rank under ``sharding``) and returns it with the resident
    memory and what remains for the forward and backward passes (the budget a solver gets,
    on :func:`~chkpt_opt.step_budget.sharding.per_rank_graph` of ``graph``)."""
    parsed = parse_budget(budget, device_total_bytes=_device_total_bytes(graph))
    static = static_memory_for(graph, optimizer, sharding=sharding)
    return parsed, static, split_budget(parsed, static)


@dataclass(frozen=True, kw_only=True)
class StepSolveResult(SolveResult):
    """What :func:`solve` returns: the solver's :class:`~chkpt_opt.solvers.SolveResult`, in
    activation bytes as every solver reports them (``peak_bytes``: the simulated
    forward/backward peak, ``simulate(graph, result.schedule).peak_bytes``;
    ``budget_bytes``: what the solver was given), with the whole step's figures beside them.

    Attributes:
        step_budget_bytes: the whole-step budget asked for.
        resident_bytes: bytes resident through the whole step (parameters, buffers, inputs,
            optimizer state); ``budget_bytes == step_budget_bytes - resident_bytes``.
        step_peak_bytes: predicted peak of the whole step under ``schedule``
            (:meth:`~chkpt_opt.step_budget.budget.StaticMemory.step_peak_bytes` of ``peak_bytes``).
        static: the resident memory in parts, and the optimizer phase.
    """

    step_budget_bytes: int
    resident_bytes: int
    step_peak_bytes: int
    static: StaticMemory


@dataclass(frozen=True)
class StepProfile:
    """What :func:`simulate_step` returns: the simulator's profile (activation bytes) with the
    whole step's figures beside it.

    Attributes:
        profile: ``simulate(graph, schedule)``: the forward/backward timeline and cost.
        resident_bytes: bytes resident through the whole step (see :class:`StepSolveResult`).
        step_peak_bytes: the whole step's peak: resident bytes plus the larger of
            ``peak_bytes`` and the optimizer phase.
        static: the resident memory in parts, and the optimizer phase.
    """

    profile: MemoryProfile
    resident_bytes: int
    step_peak_bytes: int
    static: StaticMemory

    @property
    def peak_bytes(self) -> int:
        """The forward/backward (activation) peak: ``profile.peak_bytes``, the quantity the
        solvers take and report."""
        return self.profile.peak_bytes


def simulate_step(
    graph: CostGraph,
    schedule: Schedule,
    *,
    optimizer: OptimizerArg = "adamw",
    sharding: Sharding | None = None,
) -> StepProfile:
    """:func:`~chkpt_opt.memory_model.simulate.simulate` of ``schedule``, with the whole step's peak
    for ``optimizer`` (a name, an optimizer instance, or None for no optimizer state), on one
    rank of ``sharding`` where given."""
    profile = simulate(per_rank_graph(graph, sharding), schedule)
    static = static_memory_for(graph, optimizer, sharding=sharding)
    return StepProfile(
        profile=profile,
        resident_bytes=static.resident_bytes,
        step_peak_bytes=static.step_peak_bytes(profile.peak_bytes),
        static=static,
    )


def solve(
    graph: CostGraph,
    budget: int | str | Budget,
    *,
    solver: str = "auto",
    time_limit_s: float | None = None,
    optimizer: OptimizerArg = "adamw",
    sharding: Sharding | None = None,
    **settings: Any,
) -> StepSolveResult:
    """Finds a schedule of ``graph`` for a whole-step ``budget``.

    The resident memory (parameters, buffers, inputs, optimizer state) is subtracted first
    (:func:`chkpt_opt.step_budget.budget.split_budget`); the solver gets the rest, in activation
    bytes. The result is the solver's, in those bytes, with the whole-step figures beside them
    (:class:`StepSolveResult`). Under ``sharding`` the budget is one rank's
    (:mod:`chkpt_opt.step_budget.sharding`) and the graph traced at one rank's local batch.

    Raises:
        BudgetError: if the budget cannot be parsed or is below the resident memory.
    """
    parsed, static, act = activation_budget(graph, budget, optimizer=optimizer, sharding=sharding)
    rank_graph = per_rank_graph(graph, sharding)
    result = get_solver(solver, **settings)(rank_graph, act, time_limit_s=time_limit_s)
    return StepSolveResult(
        **{f.name: getattr(result, f.name) for f in dataclasses.fields(SolveResult)},
        step_budget_bytes=parsed.total_bytes,
        resident_bytes=static.resident_bytes,
        step_peak_bytes=static.step_peak_bytes(result.peak_bytes),
        static=static,
    )


def unmet_budget_error(
    graph: CostGraph,
    budget: Budget,
    static: StaticMemory,
    activation_budget_bytes: int,
    *,
    time_limit_s: float | None = None,
    nesting: bool = True,
    scope: str = "for this model and inputs",
    fix: str = "Raise the budget to at least that, or reduce the batch size.",
    lowest: SolveResult | None = None,
) -> InfeasibleBudgetError:
    """The error for a whole-step ``budget`` (split into ``static`` and
    ``activation_budget_bytes``) that no schedule of ``graph`` the solvers find meets: it
    names the smallest step budget they meet (:func:`~chkpt_opt.solvers.smallest_peak`,
    searched within ``time_limit_s``, with nested regions unless ``nesting`` is False), in
    parts, what that budget is proven the smallest of, ``scope`` (the schedules it holds
    for) and ``fix``. ``lowest``: that search's result where the caller ran it already (with
    nested regions; then nothing is searched)."""
    if lowest is None:
        lowest = smallest_peak(graph, time_limit_s=time_limit_s, nesting=nesting)
    minimum = static.step_peak_bytes(lowest.peak_bytes)
    given, needed = format_bytes_pair(budget.total_bytes, minimum)
    return InfeasibleBudgetError(
        f"budget {budget.text!r} = {given} is below "
        f"{smallest_budget_phrase(lowest)} {scope}: {needed} ({minimum} bytes; "
        f"resident {format_bytes(static.resident_bytes)} + forward/backward "
        f"{format_bytes(lowest.peak_bytes)}). {fix}",
        budget_bytes=activation_budget_bytes,
        min_feasible_bytes=minimum,
        exact=bool(lowest.stats.get("min_feasible_proven")),
    )


def smallest_budget_phrase(lowest: SolveResult) -> str:
    """What the lowest peak found (``lowest``, from
    :func:`~chkpt_opt.solvers.smallest_peak`) is proven the smallest of: every schedule's
    where the recompute bound's floor (which holds over every schedule) meets it, keep-set
    schedules' where only a keep-set search proved it."""
    if not lowest.stats.get("min_feasible_proven"):
        return "the smallest budget the available solvers can meet"
    cover = lowest.stats.get("recompute_bound")
    floor_bytes = cover.get("floor_bytes", 0) if isinstance(cover, dict) else 0
    if floor_bytes >= lowest.peak_bytes:
        return "the smallest budget any schedule can meet"
    return "the smallest budget any keep-set schedule can meet"
