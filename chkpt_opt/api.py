"""The public API: trace, solve, simulate, plan, optimize.

Units: a solver (``get_solver(name)(graph, bytes)``) takes and reports activation bytes, the
bytes created during the forward and backward passes, which is what
``simulate(graph, schedule).peak_bytes`` reports. :func:`solve` and :func:`plan` take the
budget of the whole training step; their results carry the activation figures under the
same names (``peak_bytes``, ``budget_bytes``) and the whole-step figures beside them
(``step_budget_bytes``, ``resident_bytes``, ``step_peak_bytes``), as does
:func:`simulate_step`.

Example:
    >>> import torch, chkpt_opt
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    >>> x = torch.randn(32, 64)
    >>> plan = chkpt_opt.plan(net, (x,), budget="1MB", optimizer=None)
    >>> plan.predicted_peak_bytes <= 1_000_000
    True
    >>> optimized = plan.apply()   # train it like `net`; it shares net's parameters
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from chkpt_opt.budget import (
    Budget,
    OptimizerSpec,
    StaticMemory,
    format_bytes,
    graph_static_memory,
    optimizer_spec,
    parse_budget,
    split_budget,
    static_memory,
)
from chkpt_opt.codegen import apply_schedule
from chkpt_opt.errors import BudgetError, InfeasibleBudgetError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.tracer import Traced, trace_model
from chkpt_opt.schedule import Schedule
from chkpt_opt.schedule_io import load_schedule, save_schedule
from chkpt_opt.simulate import MemoryProfile, simulate
from chkpt_opt.solvers import SolveResult, get_solver, smallest_peak

log = logging.getLogger(__name__)

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


def static_memory_for(graph: CostGraph, optimizer: OptimizerArg = "adamw") -> StaticMemory:
    """The resident memory of a training step of ``graph`` with ``optimizer``.

    A named optimizer is assumed to train every trainable parameter; an optimizer instance
    is sized by the parameters of its own parameter groups.
    """
    spec, foreach = _spec_of(optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer):
        return graph_static_memory(graph.graph, spec, foreach=foreach)
    params = {
        id(p): p for group in optimizer.param_groups for p in group["params"] if p.requires_grad
    }.values()  # frozen parameters get no gradient, hence no state
    sizes = [p.numel() * p.element_size() for p in params]
    g = graph.graph
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
    return dataclasses.replace(static, grad_bytes=g["trainable_param_bytes"])


def _device_total_bytes(graph: CostGraph) -> int | None:
    if graph.graph.get("device_type") == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return None


def activation_budget(
    graph: CostGraph, budget: int | str | Budget, *, optimizer: OptimizerArg = "adamw"
) -> tuple[Budget, StaticMemory, int]:
    """Parses a step budget and returns it with the resident memory and what remains for the
    forward and backward passes (the budget a solver gets)."""
    parsed = parse_budget(budget, device_total_bytes=_device_total_bytes(graph))
    static = static_memory_for(graph, optimizer)
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
            (:meth:`~chkpt_opt.budget.StaticMemory.step_peak_bytes` of ``peak_bytes``).
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
    graph: CostGraph, schedule: Schedule, *, optimizer: OptimizerArg = "adamw"
) -> StepProfile:
    """:func:`~chkpt_opt.simulate.simulate` of ``schedule``, with the whole step's peak for
    ``optimizer`` (a name, an optimizer instance, or None for no optimizer state)."""
    profile = simulate(graph, schedule)
    static = static_memory_for(graph, optimizer)
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
    **settings: Any,
) -> StepSolveResult:
    """Finds a schedule of ``graph`` for a whole-step ``budget``.

    The resident memory (parameters, buffers, inputs, optimizer state) is subtracted first
    (:func:`chkpt_opt.budget.split_budget`); the solver gets the rest, in activation bytes.
    The result is the solver's, in those bytes, with the whole-step figures beside them
    (:class:`StepSolveResult`).

    Raises:
        BudgetError: if the budget cannot be parsed or is below the resident memory.
    """
    parsed, static, act = activation_budget(graph, budget, optimizer=optimizer)
    result = get_solver(solver, **settings)(graph, act, time_limit_s=time_limit_s)
    return StepSolveResult(
        **{f.name: getattr(result, f.name) for f in dataclasses.fields(SolveResult)},
        step_budget_bytes=parsed.total_bytes,
        resident_bytes=static.resident_bytes,
        step_peak_bytes=static.step_peak_bytes(result.peak_bytes),
        static=static,
    )


@dataclass
class Plan:
    """A solved plan for one model, budget and optimizer.

    Attributes:
        graph: the model's cost graph.
        result: the solver's result.
        budget: the whole-step budget.
        static: resident memory of the step (parameters, buffers, inputs, optimizer state).
        activation_budget_bytes: what the schedule may use in forward and backward.
        profile: the simulated memory timeline of the schedule.
    """

    graph: CostGraph
    result: SolveResult
    budget: Budget
    static: StaticMemory
    activation_budget_bytes: int
    profile: MemoryProfile
    traced: Traced = field(repr=False)

    @property
    def schedule(self) -> Schedule:
        """The schedule the plan runs."""
        return self.result.schedule

    @property
    def predicted_peak_bytes(self) -> int:
        """Predicted peak of the whole training step: resident memory plus the larger of the
        forward/backward peak and the optimizer phase."""
        return self.static.step_peak_bytes(self.profile.peak_bytes)

    def apply(self, *, for_compile: bool = False) -> torch.nn.Module:
        """Returns a new module that runs the schedule; it shares the model's parameters.

        With ``for_compile=True`` the module is meant for ``torch.compile``: its recompute
        regions become regions that the compiled backward recomputes.
        """
        module = self.traced.captured.fresh_module()
        return apply_schedule(module, self.graph, self.schedule, for_compile=for_compile)

    def compile(self, **compile_kwargs: Any) -> Any:
        """The plan compiled with ``torch.compile``, its keep/recompute decisions honoured.

        Same as ``chkpt_opt.compile_module(plan.apply(for_compile=True), **compile_kwargs)``
        (see :mod:`chkpt_opt.export.partitioner`).
        """
        from chkpt_opt.export.partitioner import compile_module

        return compile_module(self.apply(for_compile=True), **compile_kwargs)

    def save(self, path: str | Path) -> None:
        """Writes the plan as a versioned schedule file (JSON; see ``schemas/``).

        ``chkpt_opt.apply(model, path, example_inputs)`` rebuilds the optimized module from
        it without solving, in another process or on another machine.
        """
        r = self.result
        save_schedule(
            path,
            self.graph,
            self.schedule,
            budget_bytes=self.budget.total_bytes,
            activation_budget_bytes=self.activation_budget_bytes,
            predicted_peak_bytes=self.predicted_peak_bytes,
            forward_backward_peak_bytes=self.profile.peak_bytes,
            resident_bytes=self.static.resident_bytes,
            solver=r.solver,
            status=r.status.value,
            objective_s=r.objective,
            bound_s=r.bound,
            torch_version=str(torch.__version__),
            chkpt_opt_version=_version(),
        )

    def summary(self) -> str:
        """Human-readable lines: budget, its split, the prediction, and the solver's status."""
        s = self.static
        r = self.result
        lines = [
            f"budget: {format_bytes(self.budget.total_bytes)}",
            f"  resident: {format_bytes(s.resident_bytes)} "
            f"(parameters {format_bytes(s.param_bytes)}, "
            f"optimizer state {format_bytes(s.optimizer_state_bytes)}, buffers+inputs "
            f"{format_bytes(s.buffer_bytes + s.input_bytes)})",
            f"  for forward/backward: {format_bytes(self.activation_budget_bytes)}",
            f"predicted peak: {format_bytes(self.predicted_peak_bytes)} "
            f"(forward/backward {format_bytes(self.profile.peak_bytes)})",
            f"schedule: {len(self.schedule.regions)} recompute regions, "
            f"{len(self.schedule.recomputed_nodes())} of {self.graph.number_of_nodes()} ops; "
            f"estimated extra compute {self.profile.overhead:.1%}",
            f"solver: {r.solver} -> {r.status.value}"
            + (f" (gap {r.gap:.2%})" if r.gap is not None else "")
            + f" in {r.solve_s:.2f}s",
        ]
        return "\n".join(lines)


def plan(
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    budget: int | str | Budget,
    solver: str = "auto",
    optimizer: OptimizerArg = "adamw",
    example_kwargs: dict[str, Any] | None = None,
    time_limit_s: float | None = None,
    tracer: str = "auto",
    profile_times: bool = False,
) -> Plan:
    """Traces ``model`` and solves for the cheapest schedule whose whole step fits ``budget``.

    Args:
        model: the model, in the mode it will train in (``model.train()``).
        example_inputs: positional inputs of one step (tensors, or nested containers of them).
        budget: peak memory of the whole training step: ``"20GB"``, ``"20GiB"``, bytes, or
            ``"80%"`` of the CUDA device.
        solver: a registered solver name (see :func:`available_solvers`) or ``"auto"``.
        optimizer: ``"adamw"`` (default), ``"adam"``, ``"sgd"``, another known name, a
            torch.optim optimizer instance, or None to count no optimizer state.
        example_kwargs: keyword inputs of one step.
        time_limit_s: time limit of the whole call, tracing included: the solver gets what
            the trace left (at least one second), and so does the search for the smallest
            feasible budget when the budget cannot be met.
        tracer: ``"auto"`` (torch.export, then torch.fx), ``"export"`` or ``"fx"``.
        profile_times: time every op's forward on the model's device, so the solver weighs
            recomputation by measured rather than estimated times (runs the model once).

    Raises:
        BudgetError: unreadable budget, or below the resident memory.
        InfeasibleBudgetError: no schedule fits; the message states the smallest budget that
            the available solvers can meet, in GB and GiB.
        TraceError: the model or its inputs cannot be traced.
    """
    start = time.perf_counter()

    def left_s() -> float | None:
        if time_limit_s is None:
            return None
        return max(1.0, time_limit_s - (time.perf_counter() - start))

    traced = trace_model(
        model, example_inputs, example_kwargs, method=tracer, profile_times=profile_times
    )
    graph = traced.graph
    parsed, static, act = activation_budget(graph, budget, optimizer=optimizer)
    result = get_solver(solver)(graph, act, time_limit_s=left_s())
    if not result.feasible:
        lowest = smallest_peak(graph, time_limit_s=left_s())
        minimum = static.step_peak_bytes(lowest.peak_bytes)
        proven = bool(lowest.stats.get("min_feasible_proven"))
        how = (
            "the smallest budget any schedule can meet"
            if proven
            else ("the smallest budget the available solvers can meet")
        )
        raise InfeasibleBudgetError(
            f"budget {parsed.text!r} = {format_bytes(parsed.total_bytes)} is below {how} "
            "for this model and inputs: "
            f"{format_bytes(minimum)} ({minimum} bytes; "
            f"resident {format_bytes(static.resident_bytes)}"
            f" + forward/backward {format_bytes(lowest.peak_bytes)}). Raise the budget to at least "
            "that, or reduce the batch size.",
            budget_bytes=act,
            min_feasible_bytes=minimum,
            exact=proven,
        )
    profile = simulate(graph, result.schedule)
    made = Plan(
        graph=graph,
        result=result,
        budget=parsed,
        static=static,
        activation_budget_bytes=act,
        profile=profile,
        traced=traced,
    )
    log.info("chkpt_opt plan for %s:\n%s", type(model).__name__, made.summary())
    return made


def apply(
    model: torch.nn.Module,
    path: str | Path,
    example_inputs: Any,
    example_kwargs: dict[str, Any] | None = None,
    *,
    tracer: str = "auto",
    for_compile: bool = False,
) -> torch.nn.Module:
    """Rebuilds the optimized module from a schedule file, without solving.

    The model is traced (on fake tensors) to rebuild its graph; the file is refused if it
    was made for another model or other input shapes. ``for_compile`` as in
    :meth:`Plan.apply`.

    Raises:
        ScheduleError: malformed file, other format version, or a fingerprint mismatch.
    """
    loaded = load_schedule(path)
    traced = trace_model(model, example_inputs, example_kwargs, method=tracer)
    loaded.check_against(traced.graph)
    return apply_schedule(
        traced.captured.fresh_module(), traced.graph, loaded.schedule, for_compile=for_compile
    )


def _version() -> str:
    from chkpt_opt import __version__

    return __version__


def optimize(
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    budget: int | str | Budget,
    **kwargs: Any,
) -> torch.nn.Module:
    """``plan(model, example_inputs, budget=..., **kwargs).apply()``.

    The returned module computes the same function as ``model`` and shares its Parameter
    objects, so an optimizer built on ``model.parameters()`` trains it.
    """
    return plan(model, example_inputs, budget=budget, **kwargs).apply()


def trace(
    model: torch.nn.Module,
    example_inputs: Any,
    example_kwargs: dict[str, Any] | None = None,
    *,
    name: str | None = None,
    tracer: str = "auto",
) -> CostGraph:
    """Traces ``model`` on example inputs into a CostGraph (see :mod:`chkpt_opt.graphs`)."""
    return trace_model(model, example_inputs, example_kwargs, name=name, method=tracer).graph
