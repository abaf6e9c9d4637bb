"""The public API: trace, solve, simulate, plan (the in-place ``optimize`` is in
:mod:`chkpt_opt.attachment`).

Words: to *trace* a model is to turn it and example inputs into a CostGraph (the tracer on
fake tensors, then what :mod:`chkpt_opt.measurement` measures on the device); to *apply* a
schedule to a model is to return a new module that runs the schedule and shares the model's
Parameters and buffers (codegen's :func:`~chkpt_opt.codegen.rewrite_module`).

Units: solvers and the simulator count activation bytes (what the forward and backward
passes create); :func:`solve` and :func:`plan` take the budget of the whole training step
and report both (see :mod:`chkpt_opt.step_budget.whole_step`, where :func:`solve`,
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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from chkpt_opt.api.solved_plan import Plan
from chkpt_opt.attachment.call_inputs import measures_times, training_kwargs, with_call_defaults
from chkpt_opt.attachment.held_outputs import droppable, dropping_outputs
from chkpt_opt.codegen import rewrite_module
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.tracer import Traced, trace_model
from chkpt_opt.measurement import measure_traced, trace_and_measure
from chkpt_opt.measurement.timed_choice import (
    fitting_layouts,
    prepare_choice,
    rounds_left,
    wanted,
    with_timed_choice,
)
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.schedule_io import load_schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers import SolveResult, get_solver, smallest_peak
from chkpt_opt.solvers.base import result_from_profile
from chkpt_opt.solvers.deadline import NO_DEADLINE, Deadline, stage
from chkpt_opt.solvers.registry import solver_settings as given_settings
from chkpt_opt.step_budget.budget import Budget
from chkpt_opt.step_budget.sharding import (
    Sharding,
    per_rank_graph,
    traced_module_and_sharding,
)
from chkpt_opt.step_budget.whole_step import (
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

MIN_SOLVE_S = 5.0
"""The least time the solver gets, however little the stages before it left: on 2 cores
under a load of 8, a 2-layer Llama's capture took 10.9 s of a 10 s limit, and ``auto`` left
1 s found no schedule where HF checkpointing's budget fits (its heuristics alone took 1.6 s
there)."""


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
    outputs_held: bool = True,
    timed_choice: bool | None = None,
    gap: float | None = None,
    stall_s: float | None = None,
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
        example_kwargs: keyword inputs of one step; ``use_cache=False`` is added where the
            model takes it (through wrappers such as ``peft``'s) and they do not say, as
            :func:`chkpt_opt.optimize` does (:mod:`chkpt_opt.attachment.call_inputs`).
        time_limit_s: time limit of the whole call: one deadline from its start for the
            capture, the op timing, the solve (what they leave, less what the timed
            choice reserves; at least :data:`MIN_SOLVE_S`) and the timed choice (what the
            solve leaves); the search for the smallest feasible budget, when the budget
            cannot be met, gets what is left too (at least :data:`MIN_SOLVE_S`). None: each
            solve's own default (``auto``: 60 s). ``result.stats["planning_s"]`` holds each
            stage's seconds.
        tracer: ``"auto"`` (torch.export, then torch.fx), ``"export"`` or ``"fx"``.
        profile_times: time every op's forward on the model's device, so the solver weighs
            recomputation by measured rather than estimated times (runs the model a few
            times), and measure what one recompute region costs beyond its ops there
            (:mod:`chkpt_opt.measurement.region_costs`), which every region of a plan is
            charged: what :func:`trace` measures with it.
            None (the default): as :func:`chkpt_opt.optimize`, measured wherever the
            model's tensors are real, the CPU included, estimated on the meta device
            (:func:`chkpt_opt.attachment.call_inputs.measures_times`). The roofline
            estimate misjudges small kernels: the zoo GPT and ResNet planned at half their
            activations on an H200 ran at 2.86x and 3.21x the original's step time on it,
            and at 1.49x and 1.67x planned on measured times
            (``benchmarks/results/cuda/cuda_times.md``); on the CPU the padded Llama of
            ``benchmarks/padded.py`` at HF checkpointing's peak ran 2.22x the original on
            estimated times. False: the estimate, so the same model and budget give the
            same plan.
        sharding: plan one rank of sharded training
        (:class:`chkpt_opt.step_budget.sharding.Sharding`:
            FSDP2 or DDP, the world size); ``budget`` is then per rank and the example
            inputs one rank's local batch. None: read off a DDP-wrapped model, else one
            device. Plan a model before ``fully_shard`` (its sharded parameters cannot be
            captured).
        outputs_held: whether the loop holds the model's outputs beside the loss (the
            logits) through the backward pass: True (the default) for ``outputs =
            model(**batch); outputs.loss.backward()``, False for
            ``model(**batch).loss.backward()`` and ``Trainer``, which drop them when the
            forward returns (their bytes are then free for activations); as
            ``chkpt_opt.optimize(outputs_held=...)``.
        timed_choice: as :func:`plan_traced` (by default on for solver ``auto`` on
            measured op times, on one device).
        gap: the relative gap at which the solve stops, where ``solver`` takes one
            (``auto``: a schedule within ``gap`` of a proven bound returns at once); None:
            the solver's own (``auto``'s: 1%).
        stall_s: where ``solver`` takes one (``auto``), the seconds without a better
            schedule after which its searches beyond keep-set stop; None: the solver's own
            (``auto``'s: never before the limit).

    Raises:
        BudgetError: unreadable budget, or below the resident memory.
        InfeasibleBudgetError: no schedule fits; the message states the smallest budget that
            the available solvers can meet, in GB and GiB.
        TraceError: the model or its inputs cannot be traced.
    """
    deadline = Deadline.after(time_limit_s)  # one limit for every stage of planning
    seconds: dict[str, float] = {}
    model, sharding = traced_module_and_sharding(model, sharding)
    traced = _traced(
        model, example_inputs, example_kwargs, tracer, profile_times, stages=(deadline, seconds)
    )
    if not outputs_held and droppable(traced.graph):
        traced = dataclasses.replace(traced, graph=dropping_outputs(traced.graph))
    made = plan_traced(
        traced,
        budget=budget,
        solver=solver,
        optimizer=optimizer,
        sharding=sharding,
        timed_choice=timed_choice,
        deadline=deadline,
        stage_s=seconds,
        solver_settings=given_settings(gap=gap, stall_s=stall_s),
    )
    log.info("chkpt_opt plan for %s:\n%s", type(model).__name__, made.summary())
    return made


def _traced(
    model: torch.nn.Module,
    example_inputs: Any,
    example_kwargs: dict[str, Any] | None,
    tracer: str,
    profile_times: bool | None,
    *,
    name: str | None = None,
    stages: tuple[Deadline, dict[str, float]] | None = None,
) -> Traced:
    """The capture of one training call and its cost graph, measured as asked: the rules
    that :func:`plan`, :func:`trace` and the attachment share
    (:mod:`chkpt_opt.attachment.call_inputs`). ``stages``: the planning's deadline and its
    seconds by stage (``"capture"``, ``"op timing"``), logged and added to."""
    kwargs = training_kwargs(model, example_kwargs)
    stages = stages or (NO_DEADLINE, {})
    with stage("capture", *stages):
        traced = trace_and_measure(model, example_inputs, kwargs, name=name, method=tracer)
    with stage("op timing", *stages):
        measured = measures_times(profile_times, traced.graph)
        return measure_traced(traced, profile_times=measured, deadline=stages[0])


def plan_traced(
    traced: Traced,
    *,
    budget: int | str | Budget,
    solver: str = "auto",
    optimizer: OptimizerArg = "adamw",
    time_limit_s: float | None = None,
    sharding: Sharding | None = None,
    timed_choice: bool | None = None,
    deadline: Deadline | None = None,
    stage_s: dict[str, float] | None = None,
    solver_settings: Mapping[str, Any] | None = None,
) -> Plan:
    """:func:`plan` for a model already traced: the budget split, the solve and the
    simulation of its schedule, on ``traced.graph`` as it is (measure it first through
    :func:`chkpt_opt.measurement.measure_traced`, as :func:`plan` does). ``time_limit_s``
    bounds this call (at least :data:`MIN_SOLVE_S` for the solver, and again for the search
    for the smallest feasible budget when the budget cannot be met); ``sharding`` as in
    :func:`plan`; ``solver_settings``: the solver's settings
    (:func:`~chkpt_opt.solvers.registry.solver_settings`).

    ``timed_choice``: time the solver's schedule against the model's own checkpointing
    layouts that fit the budget and keep the fastest
    (:mod:`chkpt_opt.measurement.timed_choice`; ``result.stats["timed_choice"]``). By
    default on where it means something: solver ``auto``, op times measured on the
    model's device, one device (no ``sharding``).

    ``deadline``: the limit of the whole planning this call is part of (capture and op
    timing before it: :func:`plan` and the attachment start it before capturing), in
    place of ``time_limit_s`` counted from here; the solve gets what is left of it, less
    the time the timed choice reserves (at least :data:`MIN_SOLVE_S`), the timed choice
    what the solve leaves. ``stage_s``: seconds by planning stage, added to (``"solve"``,
    ``"timed choice"``); ``result.stats["planning_s"]`` holds them, with those of the
    stages before this call written there by the caller.

    Raises:
        BudgetError, InfeasibleBudgetError: as :func:`plan`.
    """
    deadline = Deadline.after(time_limit_s) if deadline is None else deadline
    seconds: dict[str, float] = {} if stage_s is None else stage_s

    def left_s(reserved_s: float = 0.0) -> float | None:
        left = deadline.remaining_s()
        return None if left is None else max(MIN_SOLVE_S, left - reserved_s)

    graph = traced.graph
    parsed, static, act = activation_budget(graph, budget, optimizer=optimizer, sharding=sharding)
    graph = per_rank_graph(graph, sharding)
    if timed_choice is None:
        timed_choice = wanted(graph, solver=solver, sharded=sharding is not None)
    layouts, rounds, reserved_s = (
        prepare_choice(graph, act, time_limit_s=deadline.remaining_s())
        if timed_choice
        else ({}, 0, 0.0)
    )
    with stage("solve", deadline, seconds):
        solve = get_solver(solver, **(solver_settings or {}))
        result = solve(graph, act, time_limit_s=left_s(reserved_s))
        if not result.feasible and not result.proves_infeasible:
            result = _own_layout_if_it_fits(graph, act, result, layouts)
        lowest = None  # the lowest-peak search's result, where the solve ran out of time
        if not result.feasible and not result.proves_infeasible and deadline.expired():
            lowest = smallest_peak(graph, time_limit_s=left_s())
            result = _lowest_if_it_fits(graph, act, result, lowest)
    if not result.feasible:
        raise unmet_budget_error(graph, parsed, static, act, time_limit_s=left_s(), lowest=lowest)
    if timed_choice:
        rounds = rounds_left(rounds, reserved_s, deadline.remaining_s())
        with stage("timed choice", deadline, seconds):
            result = with_timed_choice(traced, graph, result, layouts, rounds, deadline=deadline)
    planning = {name: round(s, 3) for name, s in seconds.items()}
    result = dataclasses.replace(result, stats={**result.stats, "planning_s": planning})
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


def _own_layout_if_it_fits(
    graph: CostGraph, budget_bytes: int, result: SolveResult, layouts: dict[str, Schedule]
) -> SolveResult:
    """``result`` (nothing that fits, nothing proven), or the cheapest of the model's own
    layouts that fits ``budget_bytes`` (``layouts``: those the timed choice found fitting;
    else looked up here): a solve cut short by its limit is never worse than the line the
    model already has (a 32-layer Llama given 10 s, 15 s of them capture under load, found
    nothing that fit where a region per layer does)."""
    fitting = layouts or fitting_layouts(graph, budget_bytes)
    if not fitting:
        return result
    profiles = {name: simulate(graph, layout) for name, layout in fitting.items()}
    name = min(profiles, key=lambda n: (profiles[n].recompute_s, n))
    log.info("planning: the solve found nothing that fits in its time; the model's own %s do", name)
    return result_from_profile(
        fitting[name],
        profiles[name],
        budget_bytes=budget_bytes,
        solver=result.solver,
        solve_s=result.solve_s,
        stats={
            **result.stats,
            "chosen": f"own layout: {name}",
            "solve_cut_short": result.status.value,
        },
    )


def _lowest_if_it_fits(
    graph: CostGraph, budget_bytes: int, result: SolveResult, lowest: SolveResult
) -> SolveResult:
    """``result`` (nothing that fits, nothing proven), or the lowest-peak schedule
    (``lowest``, from :func:`~chkpt_opt.solvers.smallest_peak`) where it fits
    ``budget_bytes``: a solve cut short by the stages before it (a capture that took the
    whole limit under load) can miss what the lowest-peak search finds."""
    if lowest.peak_bytes > budget_bytes:
        return result
    log.info("planning: the solve found nothing that fits in its time; the lowest peak does")
    profile = simulate(graph, lowest.schedule)
    return result_from_profile(
        lowest.schedule,
        profile,
        budget_bytes=budget_bytes,
        solver=result.solver,
        solve_s=result.solve_s + lowest.solve_s,
        stats={"chosen": "smallest_peak", "solve_cut_short": result.status.value},
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
    kwargs = training_kwargs(model, example_kwargs)
    traced = trace_model(model, example_inputs, kwargs, method=tracer)
    loaded.check_against(traced.graph)
    rewritten = rewrite_module(
        traced.captured.fresh_module(), traced.graph, loaded.schedule, for_compile=for_compile
    )
    return with_call_defaults(rewritten, traced.kwargs)  # calls that leave use_cache out


def trace(
    model: torch.nn.Module,
    example_inputs: Any,
    example_kwargs: dict[str, Any] | None = None,
    *,
    name: str | None = None,
    tracer: str = "auto",
    profile_times: bool | None = False,
) -> CostGraph:
    """Traces ``model`` on example inputs into a CostGraph (see :mod:`chkpt_opt.graphs`),
    with what is measured on its device written in (:mod:`chkpt_opt.measurement`): on CUDA
    the kernel workspace, and with ``profile_times`` every op's time and what regions cost
    beyond their ops (None: as :func:`plan` measures by default). :func:`plan` traces the
    same way (``use_cache=False`` added where the model takes it), so ``trace`` then
    ``solve`` sees the graph ``plan`` solves with the same ``profile_times``."""
    return _traced(model, example_inputs, example_kwargs, tracer, profile_times, name=name).graph
