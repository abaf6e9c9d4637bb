"""A solved plan: the schedule, the budget split and the prediction, for one model.

:func:`chkpt_opt.plan` and :func:`chkpt_opt.api.plan_traced` make it; it applies itself to
its model (:meth:`Plan.apply`), times itself against the model's own checkpointing
(:meth:`Plan.timed`), gives the plan the compiled step runs (:meth:`Plan.for_compile`),
saves itself as a schedule file (:meth:`Plan.save`) and describes itself
(:meth:`Plan.summary`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from chkpt_opt.attachment.call_inputs import with_call_defaults
from chkpt_opt.codegen import rewrite_module
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.tracer import Traced
from chkpt_opt.measurement.timed_choice import TIMED_ROUNDS, fitting_layouts, with_timed_choice
from chkpt_opt.measurement.timed_choice import describe as describe_timed_choice
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.schedule_io import save_schedule
from chkpt_opt.memory_model.simulate import MemoryProfile, simulate
from chkpt_opt.solvers import SolveResult, get_solver
from chkpt_opt.step_budget.budget import Budget, StaticMemory, format_bytes
from chkpt_opt.step_budget.sharding import Sharding, sharding_meta
from chkpt_opt.step_budget.whole_step import unmet_budget_error


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
            is then the per-rank graph (:func:`chkpt_opt.step_budget.sharding.per_rank_graph`).
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
        """Applies the plan's schedule to its model (see :mod:`chkpt_opt.api`): a new module
        that runs it and shares the model's Parameters and buffers.

        With ``for_compile=True`` the module is meant for ``torch.compile``: its recompute
        regions become regions that the compiled backward recomputes, and their cached ops
        are saved. It runs the schedule of :meth:`for_compile` (the plan without nesting,
        where this plan's schedule nests regions).
        """
        plan = self.for_compile() if for_compile else self
        module = plan.traced.captured.fresh_module()
        rewritten = rewrite_module(module, plan.graph, plan.schedule, for_compile=for_compile)
        return with_call_defaults(rewritten, plan.traced.kwargs)  # use_cache left out

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

    def for_compile(
        self,
        *,
        time_limit_s: float | None = None,
        solver_settings: Mapping[str, Any] | None = None,
    ) -> Plan:
        """The plan that the compiled step runs: this plan when its regions do not nest
        (keep-set regions, cached ops inside them or not); for a schedule with nested
        regions or unpacked ops, or a staged one, the best plan without them at the same
        budget (solved once, by ``auto`` with ``nesting=False`` and ``solver_settings``:
        keep-set regions and cached ops; where that unpacks ops, the cached-op search from
        it with them kept instead, or the keep-set plan where that search finds none within
        the budget).

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
        if not self.schedule.nested and not self.schedule.unpacked and not self.schedule.staged:
            return self
        if self._compiled is None:
            settings = dict(solver_settings or {}, nesting=False)
            result = get_solver("auto", **settings)(
                self.graph, self.activation_budget_bytes, time_limit_s=time_limit_s
            )
            if result.schedule.unpacked:  # the cached-op search's; compile cannot run them
                result = get_solver(
                    "cached", warm_start=result.schedule.with_unpacked(frozenset()), unpack=False
                )(self.graph, self.activation_budget_bytes, time_limit_s=time_limit_s)
                if not result.feasible:  # none near it without them: keep-set regions
                    result = get_solver("auto", general=False)(
                        self.graph, self.activation_budget_bytes, time_limit_s=time_limit_s
                    )
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


def _version() -> str:
    from chkpt_opt import __version__

    return __version__
