"""The public API: trace, solve, simulate, plan (the in-place ``optimize`` is in
:mod:`chkpt_opt.attachment`).

Words: to *trace* a model is to turn it and example inputs into a CostGraph (the tracer on
fake tensors, then what :mod:`chkpt_opt.measurement` measures on the device); to *apply* a
schedule to a model is to return a new module that runs the schedule and shares the model's
Parameters and buffers (codegen's :func:`~chkpt_opt.codegen.rewrite_module`).

Units: solvers and the simulator count activation bytes (what the forward and backward
passes create); :func:`solve` and :func:`plan` take the budget of the whole training step
and report both (see :mod:`chkpt_opt.whole_step`, where :func:`solve`,
:func:`simulate_step` and the budget split live).

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

from chkpt_opt.budget import Budget, StaticMemory, format_bytes
from chkpt_opt.codegen import rewrite_module
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.tracer import Traced, trace_model
from chkpt_opt.measurement import trace_and_measure
from chkpt_opt.measurement.step import device_of
from chkpt_opt.measurement.timed_choice import (
    TIMED_ROUNDS,
    fitting_layouts,
    prepare_choice,
    wanted,
    with_timed_choice,
)
from chkpt_opt.measurement.timed_choice import describe as describe_timed_choice
from chkpt_opt.schedule import Schedule
from chkpt_opt.schedule_io import load_schedule, save_schedule
from chkpt_opt.sharding import (
    Sharding,
    per_rank_graph,
    sharding_meta,
    traced_module_and_sharding,
)
from chkpt_opt.simulate import MemoryProfile, simulate
from chkpt_opt.solvers import SolveResult, get_solver, smallest_peak
from chkpt_opt.whole_step import (
    OptimizerArg,
    StepProfile,
    StepSolveResult,
    activation_budget,
    simulate_step,
    solve,
    static_memory_for,
    unmet_budget_error,
)

__all__ = [
    "OptimizerArg",
    "Plan",
    "StepProfile",
    "StepSolveResult",
    "activation_budget",
    "apply",
    "plan",
    "plan_traced",
    "simulate_step",
    "smallest_peak",
    "solve",
    "static_memory_for",
    "trace",
]

log = logging.getLogger(__name__)


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
        sharding: the sharding the budget is one rank's of (None: one device); ``graph``
            is then the per-rank graph (:func:`chkpt_opt.sharding.per_rank_graph`).
    """

    graph: CostGraph
    result: SolveResult
    budget: Budget
    static: StaticMemory
    activation_budget_bytes: int
    profile: MemoryProfile
    traced: Traced = field(repr=False)
    sharding: Sharding | None = None
    _compiled: Plan | None = field(default=None, repr=False, compare=False)

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
        """Applies the plan's schedule to its model (see the module docstring): a new module
        that runs it and shares the model's Parameters and buffers.

        With ``for_compile=True`` the module is meant for ``torch.compile``: its recompute
        regions become regions that the compiled backward recomputes, and their cached ops
        are saved. It runs the schedule of :meth:`for_compile` (the plan without nesting,
        where this plan's schedule nests regions).
        """
        plan = self.for_compile() if for_compile else self
        module = plan.traced.captured.fresh_module()
        return rewrite_module(module, plan.graph, plan.schedule, for_compile=for_compile)

    def timed(self, *, rounds: int = TIMED_ROUNDS) -> Plan:
        """This plan timed against the model's own checkpointing layouts that fit its
        budget, on its example inputs (:mod:`chkpt_opt.measurement.timed_choice`): itself
        where it ran fastest or nothing else fits, else the plan of the fastest layout;
        ``result.stats["timed_choice"]`` says what was timed. Takes ``rounds`` + 1 steps
        of each candidate, with no time limit (``plan_traced`` fits them into its own)."""
        layouts = fitting_layouts(self.graph, self.activation_budget_bytes)
        result = with_timed_choice(self.traced, self.graph, self.result, layouts, rounds)
        if result.schedule == self.schedule:
            return dataclasses.replace(self, result=result)
        profile = simulate(self.graph, result.schedule)
        return dataclasses.replace(self, result=result, profile=profile, _compiled=None)

    def for_compile(self, *, time_limit_s: float | None = None) -> Plan:
        """The plan that the compiled step runs: this plan when its regions do not nest
        (keep-set regions, cached ops inside them or not); for a schedule with nested
        regions or unpacked ops, the best plan without them at the same budget (solved
        once, by ``auto`` with ``nesting=False``: keep-set regions and cached ops; where
        that unpacks ops, the cached-op search from it with them kept instead).

        The compile path hands regions to the partitioner of ``torch.compile``
        (:mod:`chkpt_opt.export.partitioner`), which saves the outputs of the ops a region
        caches and recomputes its other ops from its inputs; it does not nest
        recomputations. Running a nested schedule there would use the memory of another
        schedule than the one predicted; the prediction of the plan without nesting is
        what the compiled step is measured against (:func:`~chkpt_opt.export.compiled.
        measure_compiled`).

        Raises:
            InfeasibleBudgetError: no schedule without nesting fits the budget (this plan
                reaches it only with nested regions); the message states the smallest
                budget a compiled plan needs.
        """
        if not self.schedule.nested and not self.schedule.unpacked:
            return self
        if self._compiled is None:
            result = get_solver("auto", nesting=False)(
                self.graph, self.activation_budget_bytes, time_limit_s=time_limit_s
            )
            if result.schedule.unpacked:  # the cached-op search's; compile cannot run them
                result = get_solver(
                    "cached", warm_start=result.schedule.with_unpacked(frozenset()), unpack=False
                )(self.graph, self.activation_budget_bytes, time_limit_s=time_limit_s)
            if not result.feasible:
                raise unmet_budget_error(
                    self.graph,
                    self.budget,
                    self.static,
                    self.activation_budget_bytes,
                    time_limit_s=time_limit_s,
                    nesting=False,
                    scope="without nesting recompute regions or unpacking ops, which the "
                    "torch.compile path cannot run (its partitioner does not nest "
                    "recomputations, and it runs no saved-tensor hooks)",
                    fix="Raise the budget for the compiled plan, or run plan.apply() eagerly.",
                )
            self._compiled = dataclasses.replace(
                self, result=result, profile=simulate(self.graph, result.schedule)
            )
        return self._compiled

    def compile(self, **compile_kwargs: Any) -> Any:
        """The plan compiled with ``torch.compile``, its keep/recompute decisions honoured.

        Same as ``chkpt_opt.compile_module(plan.apply(for_compile=True), **compile_kwargs)``
        (see :mod:`chkpt_opt.export.partitioner`); it runs the schedule of
        :meth:`for_compile`.
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
            **sharding_meta(self.sharding),
        )

    def summary(self) -> str:
        """Human-readable lines: budget, its split, the prediction, and the solver's status."""
        s = self.static
        r = self.result
        lines = [
            f"budget: {format_bytes(self.budget.total_bytes)}",
            f"  resident: {format_bytes(s.resident_bytes)} ({s.describe_resident()})",
            f"  for forward/backward: {format_bytes(self.activation_budget_bytes)}",
            f"predicted peak: {format_bytes(self.predicted_peak_bytes)} "
            f"(forward/backward {format_bytes(self.profile.peak_bytes)})",
            f"schedule: {len(self.schedule.regions)} recompute regions, "
            f"{len(self.schedule.recomputed_nodes())} of {self.graph.number_of_nodes()} ops"
            + (
                f", {len(self.schedule.unpacked)} rebuilt on unpack"
                if self.schedule.unpacked
                else ""
            )
            + f"; estimated extra compute {self.profile.overhead:.1%}",
            f"solver: {r.solver} -> {r.status.value}"
            + (f" (gap {r.gap:.2%})" if r.gap is not None else "")
            + f" in {r.solve_s:.2f}s"
            + _beyond_keep_set_note(r),
        ]
        return "\n".join([*lines, describe_timed_choice(r.stats)]).rstrip("\n")


def _beyond_keep_set_note(result: SolveResult) -> str:
    """What a schedule from beyond keep-set beat: the keep-set result, and whether that
    one was proven optimal (the gap above is the recompute bound's, over every schedule)."""
    keep = result.stats.get("keep_set")
    timed = result.stats.get("timed_choice")
    if isinstance(timed, dict) and timed.get("chosen") != "plan":
        return ""  # the solver's schedule lost to a layout when timed: see that line
    if not isinstance(keep, dict) or not keep.get("objective_s") or not result.feasible:
        return ""
    if keep.get("status") not in ("optimal", "feasible"):  # no keep-set schedule fit
        return "; beyond keep-set (nested regions or cached ops): no keep-set schedule fits"
    saving = 1.0 - result.objective / keep["objective_s"]
    proven = "proven optimal " if keep.get("status") == "optimal" else ""
    return (
        f"; beyond keep-set (nested regions or cached ops), {saving:.2%} cheaper than the "
        f"{proven}keep-set schedule"
    )


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
    profile_times: bool | None = None,
    sharding: Sharding | None = None,
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
            recomputation by measured rather than estimated times (runs the model a few
            times), and measure what one recompute region costs beyond its ops there
            (:mod:`chkpt_opt.measurement.region_costs`), which every region of a plan is
            charged: what :func:`trace` measures with it.
            None (the default): on for a model on a CUDA device, off elsewhere. On a GPU
            the roofline estimate misjudges small, launch-bound kernels: the zoo GPT and
            ResNet planned at half their activations on an H200 ran at 2.86x and 3.21x the
            original's step time on it, and at 1.49x and 1.67x planned on measured times
            (``benchmarks/results/cuda/cuda_times.md``). On the CPU the estimate is kept
            by default, so the same model and budget give the same plan.
        sharding: plan one rank of sharded training (:class:`chkpt_opt.sharding.Sharding`:
            FSDP2 or DDP, the world size); ``budget`` is then per rank and the example
            inputs one rank's local batch. None: read off a DDP-wrapped model, else one
            device. Plan a model before ``fully_shard`` (its sharded parameters cannot be
            captured).

    Raises:
        BudgetError: unreadable budget, or below the resident memory.
        InfeasibleBudgetError: no schedule fits; the message states the smallest budget that
            the available solvers can meet, in GB and GiB.
        TraceError: the model or its inputs cannot be traced.
    """
    start = time.perf_counter()
    model, sharding = traced_module_and_sharding(model, sharding)
    if profile_times is None:
        profile_times = device_of(model, (example_inputs,)).type == "cuda"
    traced = trace_and_measure(
        model, example_inputs, example_kwargs, method=tracer, profile_times=profile_times
    )
    left = None if time_limit_s is None else time_limit_s - (time.perf_counter() - start)
    made = plan_traced(
        traced,
        budget=budget,
        solver=solver,
        optimizer=optimizer,
        time_limit_s=left,
        sharding=sharding,
    )
    log.info("chkpt_opt plan for %s:\n%s", type(model).__name__, made.summary())
    return made


def plan_traced(
    traced: Traced,
    *,
    budget: int | str | Budget,
    solver: str = "auto",
    optimizer: OptimizerArg = "adamw",
    time_limit_s: float | None = None,
    sharding: Sharding | None = None,
    timed_choice: bool | None = None,
) -> Plan:
    """:func:`plan` for a model already traced: the budget split, the solve and the
    simulation of its schedule, on ``traced.graph`` as it is (measure it first through
    :func:`chkpt_opt.measurement.measure_traced`, as :func:`plan` does). ``time_limit_s``
    bounds this call (at least one second for the solver, and again for the search for the
    smallest feasible budget when the budget cannot be met); ``sharding`` as in
    :func:`plan`.

    ``timed_choice``: time the solver's schedule against the model's own checkpointing
    layouts that fit the budget and keep the fastest
    (:mod:`chkpt_opt.measurement.timed_choice`; ``result.stats["timed_choice"]``). By
    default on where it means something: solver ``auto``, op times measured on the
    model's device, one device (no ``sharding``).

    Raises:
        BudgetError, InfeasibleBudgetError: as :func:`plan`.
    """
    start = time.perf_counter()

    def left_s(reserved_s: float = 0.0) -> float | None:
        if time_limit_s is None:
            return None
        return max(1.0, time_limit_s - reserved_s - (time.perf_counter() - start))

    graph = traced.graph
    parsed, static, act = activation_budget(graph, budget, optimizer=optimizer, sharding=sharding)
    graph = per_rank_graph(graph, sharding)
    if timed_choice is None:
        timed_choice = wanted(graph, solver=solver, sharded=sharding is not None)
    layouts, rounds, reserved_s = (
        prepare_choice(graph, act, time_limit_s=time_limit_s) if timed_choice else ({}, 0, 0.0)
    )
    result = get_solver(solver)(graph, act, time_limit_s=left_s(reserved_s))
    if not result.feasible:
        raise unmet_budget_error(graph, parsed, static, act, time_limit_s=left_s())
    result = with_timed_choice(traced, graph, result, layouts, rounds)
    return Plan(
        graph=graph,
        result=result,
        budget=parsed,
        static=static,
        activation_budget_bytes=act,
        profile=simulate(graph, result.schedule),
        traced=traced,
        sharding=sharding,
    )


def apply(
    model: torch.nn.Module,
    path: str | Path,
    example_inputs: Any,
    example_kwargs: dict[str, Any] | None = None,
    *,
    tracer: str = "auto",
    for_compile: bool = False,
) -> torch.nn.Module:
    """Applies the schedule saved in a file to ``model`` (see the module docstring), without
    solving: the module :meth:`Plan.apply` returns for the plan that saved it.

    The model is traced (on fake tensors) to rebuild its graph; the file is refused if it
    was made for another model or other input shapes. ``for_compile`` as in
    :meth:`Plan.apply`.

    Raises:
        ScheduleError: malformed file, other format version, or a fingerprint mismatch.
    """
    loaded = load_schedule(path)
    traced = trace_model(model, example_inputs, example_kwargs, method=tracer)
    loaded.check_against(traced.graph)
    return rewrite_module(
        traced.captured.fresh_module(), traced.graph, loaded.schedule, for_compile=for_compile
    )


def _version() -> str:
    from chkpt_opt import __version__

    return __version__


def trace(
    model: torch.nn.Module,
    example_inputs: Any,
    example_kwargs: dict[str, Any] | None = None,
    *,
    name: str | None = None,
    tracer: str = "auto",
    profile_times: bool = False,
) -> CostGraph:
    """Traces ``model`` on example inputs into a CostGraph (see :mod:`chkpt_opt.graphs`),
    with what is measured on its device written in (:mod:`chkpt_opt.measurement`): on CUDA
    the kernel workspace, and with ``profile_times`` every op's time and what regions cost
    beyond their ops. :func:`plan` traces the same way, so ``trace`` then ``solve`` sees
    the graph ``plan`` solves."""
    return trace_and_measure(
        model, example_inputs, example_kwargs, name=name, method=tracer, profile_times=profile_times
    ).graph
