"""The plan against the model's own checkpointing, timed: the faster one runs.

A plan is worth nothing to its user if it runs slower than the one line the model already
has (``gradient_checkpointing_enable()``: a region per layer). The cost model charges
regions what they were measured to cost on a small chain
(:mod:`~chkpt_opt.measurement.region_costs`), yet on a model the backward replays a region's
ops at 1.3-1.5x their forward times and each region adds more to the forward pass than it
is charged (``python benchmarks/region_cost.py --device cpu``, docs/limits.md). So where two
schedules are within that error of each other, only running them tells which is faster:
on the padded Llama of ``benchmarks/padded.py`` the plan that the model predicts 1.4%
cheaper than a region per layer ran at 1.005 ± 0.015 of its step time.

:func:`fitting_layouts` names the model's own layouts (:func:`chkpt_opt.own_layouts.own_layouts`)
that fit the activation budget; :func:`fastest` steps every candidate's rewrite on the
traced example inputs, round-robin (the order rotates each round, the first round warms
up), and returns the candidate whose median per-round time ratio to the first candidate
(the plan) is lowest, the plan on a tie. The model's buffers, gradients and RNG state are
restored afterwards (:func:`~chkpt_opt.measurement.module_state.preserved_state`).

:func:`chkpt_opt.api.plan_traced` runs it after ``auto`` on graphs whose op times were
measured, with the time it reserves from the limit (:func:`reserve_s`).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from chkpt_opt.codegen import rewrite_module
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.tracer import Traced
from chkpt_opt.measurement.driver import MEASURED
from chkpt_opt.measurement.module_state import preserved_state
from chkpt_opt.measurement.step import time_step
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.own_layouts import own_layouts
from chkpt_opt.solvers.base import SolveResult, SolveStatus
from chkpt_opt.solvers.deadline import NO_DEADLINE, Deadline

TIMED_ROUNDS = 5
"""Rounds timed after the warm-up round."""

MIN_ROUNDS = 3
"""Fewer rounds than this tell nothing on a shared machine: the choice is not made."""

RESERVE_SHARE = 0.25
"""At most this share of a time limit goes to timing the candidates."""

STEP_OVERHEAD = 1.5
"""A step's wall time against the sum of its ops' measured times (the Python around
them, the autograd engine): what :func:`reserve_s` multiplies by."""

log = logging.getLogger(__name__)

PLAN = "plan"
"""The name of the solver's schedule among the candidates."""

Timer = Callable[[torch.nn.Module, tuple[Any, ...], dict[str, Any]], float]


@dataclass(frozen=True)
class TimedChoice:
    """Which candidate ran fastest.

    Attributes:
        chosen: the candidate's name.
        ratios: each candidate's median per-round step time over the first candidate's.
        rounds: rounds timed (after the warm-up).
        seconds: wall time the choice took, warm-up included.
    """

    chosen: str
    ratios: Mapping[str, float]
    rounds: int
    seconds: float

    def as_stats(self) -> dict[str, Any]:
        """The JSON-ready form that ``SolveResult.stats["timed_choice"]`` holds."""
        return {
            "chosen": self.chosen,
            "ratios": {k: round(v, 4) for k, v in self.ratios.items()},
            "rounds": self.rounds,
            "seconds": round(self.seconds, 3),
        }


def fitting_layouts(graph: CostGraph, budget_bytes: int) -> dict[str, Schedule]:
    """The model's own layouts whose simulated peak fits ``budget_bytes``, by name."""
    return {
        name: layout
        for name, layout in own_layouts(graph).items()
        if simulate(graph, layout).peak_bytes <= budget_bytes
    }


def reserve_s(graph: CostGraph, layouts: Mapping[str, Schedule], rounds: int) -> float:
    """Seconds that timing the plan and ``layouts`` over ``rounds`` rounds (and the warm-up)
    is expected to take: every step is the graph's forward and backward op times plus the
    layout's recomputation (the plan's is taken as the costliest layout's), times
    :data:`STEP_OVERHEAD`."""
    return (rounds + 1) * _round_s(graph, layouts)


def _round_s(graph: CostGraph, layouts: Mapping[str, Schedule]) -> float:
    """Seconds one round of :func:`reserve_s` is expected to take (0 without layouts)."""
    if not layouts:
        return 0.0
    attrs = graph.nodes
    base_s = sum(attrs[n]["fwd_time_s"] + attrs[n]["bwd_time_s"] for n in graph.nodes)
    recompute = [simulate(graph, s).recompute_s for s in layouts.values()]
    steps_s = sum(base_s + r for r in recompute) + base_s + max(recompute)
    return STEP_OVERHEAD * steps_s


def rounds_within(graph: CostGraph, layouts: Mapping[str, Schedule], limit_s: float) -> int:
    """The most rounds (at most :data:`TIMED_ROUNDS`) whose :func:`reserve_s` fits
    :data:`RESERVE_SHARE` of ``limit_s``; 0 where fewer than :data:`MIN_ROUNDS` fit."""
    return _rounds_for(_round_s(graph, layouts), limit_s)


def _rounds_for(round_s: float, limit_s: float) -> int:
    """:func:`rounds_within` for rounds of ``round_s`` seconds each."""
    for rounds in range(TIMED_ROUNDS, MIN_ROUNDS - 1, -1):
        if (rounds + 1) * round_s <= RESERVE_SHARE * limit_s:
            return rounds
    return 0


def fastest(
    traced: Traced,
    graph: CostGraph,
    candidates: Mapping[str, Schedule],
    *,
    rounds: int = TIMED_ROUNDS,
    timer: Timer = time_step,
    deadline: Deadline = NO_DEADLINE,
) -> TimedChoice:
    """Times a step of each candidate's rewrite of ``traced`` on its example inputs (see
    the module docstring) and returns the fastest.

    Args:
        traced: the traced model (its capture and example inputs).
        graph: the graph the candidates were made for (``traced.graph``, or the graph a
            solver saw, e.g. with the step's outputs dropped).
        candidates: schedules by name, the reference (the plan) first.
        rounds: rounds timed after one warm-up round.
        timer: seconds of one step of a module on inputs (the default runs
            :func:`~chkpt_opt.measurement.step.time_step`).
        deadline: no round starts that the round before shows would end past it; where
            fewer than :data:`MIN_ROUNDS` rounds were timed then, the plan (the first
            candidate) is kept (``rounds`` says how many ran).

    Raises:
        ValueError: no candidate, or ``rounds`` below 1.
    """
    if not candidates:
        raise ValueError("candidates is empty; pass the plan's schedule at least")
    if rounds < 1:
        raise ValueError(f"rounds = {rounds} must be >= 1")
    names = list(candidates)
    timing_start = time.perf_counter()
    modules = {
        name: rewrite_module(traced.captured.fresh_module(), graph, candidates[name])
        for name in names
    }
    params = list(traced.captured.module.parameters())
    samples: dict[str, list[float]] = {name: [] for name in names}
    with preserved_state(traced.captured.module):
        for i in range(rounds + 1):
            round_start = time.perf_counter()
            shift = i % len(names)
            for name in names[shift:] + names[:shift]:
                for p in params:
                    p.grad = None
                elapsed = timer(modules[name], traced.args, traced.kwargs)
                if i > 0:
                    samples[name].append(elapsed)
            left_s = deadline.remaining_s()
            if i < rounds and left_s is not None and time.perf_counter() - round_start > left_s:
                log.info("timed choice: stopped after %d rounds at the time limit", i)
                break
    timed = len(samples[names[0]])
    if timed < min(rounds, MIN_ROUNDS):
        ratios = {names[0]: 1.0}
        return TimedChoice(names[0], ratios, timed, time.perf_counter() - timing_start)
    reference = samples[names[0]]
    ratios = {
        name: statistics.median(a / b for a, b in zip(samples[name], reference, strict=True))
        for name in names
    }
    chosen = min(names, key=lambda name: (ratios[name], names.index(name)))
    return TimedChoice(chosen, ratios, timed, time.perf_counter() - timing_start)


def wanted(graph: CostGraph, *, solver: str, sharded: bool) -> bool:
    """Whether a plan is timed by default: made by ``auto`` (a named solver returns its own
    schedule, for those comparing solvers), on op times measured on the model's device (a
    roofline plan is meant to be deterministic), on one device and outside a process group
    (ranks timed apart could pick different schedules, and a backward run inside DDP's
    forward would meet its gradient hooks)."""
    cost_model = str(graph.graph.get("cost_model", ""))
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return solver == "auto" and not sharded and not distributed and cost_model.startswith(MEASURED)


def prepare_choice(
    graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None
) -> tuple[dict[str, Schedule], int, float]:
    """What a timed choice after the solve needs before it: the layouts that fit, the
    rounds that the time limit leaves room for, and the seconds to reserve for them (no
    layout: ``({}, 0, 0.0)``; no room: ``(layouts, 0, 0.0)``)."""
    layouts = fitting_layouts(graph, budget_bytes)
    if not layouts:
        return {}, 0, 0.0
    round_s = _round_s(graph, layouts)
    rounds = TIMED_ROUNDS if time_limit_s is None else _rounds_for(round_s, time_limit_s)
    return layouts, rounds, (rounds + 1) * round_s if rounds else 0.0


def rounds_left(rounds: int, reserved_s: float, left_s: float | None) -> int:
    """Of the ``rounds`` that :func:`prepare_choice` reserved ``reserved_s`` seconds for,
    the most that fit in the ``left_s`` seconds left of the limit after the solve (all of
    them without a limit); 0 where fewer than :data:`MIN_ROUNDS` fit."""
    if left_s is None or rounds < 1:
        return rounds
    round_s = reserved_s / (rounds + 1)
    fitting = rounds if round_s <= 0 else min(rounds, int(left_s / round_s) - 1)
    return fitting if fitting >= MIN_ROUNDS else 0


def with_timed_choice(
    traced: Traced,
    graph: CostGraph,
    result: SolveResult,
    layouts: Mapping[str, Schedule],
    rounds: int,
    *,
    timer: Timer = time_step,
    deadline: Deadline = NO_DEADLINE,
) -> SolveResult:
    """``result`` if its schedule ran fastest against the ``layouts`` that differ from it,
    else the result of the fastest layout: its simulated peak and recomputation, status
    ``feasible`` (the solver's bound still holds; the layout is not its proven optimum).
    Either way ``stats["timed_choice"]`` says what was timed (:class:`TimedChoice`), or
    why nothing was (``"equals"``: the plan is a layout; ``"skipped"``: the reason)."""
    same = [name for name, s in layouts.items() if s == result.schedule]
    others = {name: s for name, s in layouts.items() if s != result.schedule}
    why: dict[str, str] = {}  # nothing timed: the plan is a layout, or the reason
    if same and not others:
        why = {"equals": same[0]}
    elif not others:
        why = {"skipped": "no layout of the model's own fits the budget"}
    elif rounds < 1:
        why = {"skipped": f"the time limit leaves no room for {MIN_ROUNDS} rounds"}
    if why:
        log.debug("timed choice: not made: %s", why)
        untimed = {"chosen": PLAN, **why, "ratios": {}, "rounds": 0, "seconds": 0.0}
        return dataclasses.replace(result, stats={**result.stats, "timed_choice": untimed})
    candidates = {PLAN: result.schedule, **others}
    choice = fastest(traced, graph, candidates, rounds=rounds, timer=timer, deadline=deadline)
    stats = {**result.stats, "timed_choice": choice.as_stats()}
    if choice.rounds < min(rounds, MIN_ROUNDS):
        skipped = f"the time limit left room for {choice.rounds} of {rounds} rounds"
        stats["timed_choice"] = {**choice.as_stats(), "skipped": skipped}
    if choice.chosen == PLAN:
        return dataclasses.replace(result, stats=stats)
    profile = simulate(graph, others[choice.chosen])
    return dataclasses.replace(
        result,
        schedule=others[choice.chosen],
        status=SolveStatus.FEASIBLE,
        objective=profile.recompute_s,
        peak_bytes=profile.peak_bytes,
        stats=stats,
    )


def describe(stats: Mapping[str, Any]) -> str:
    """One line on the timed choice a result's ``stats`` record (empty where none ran)."""
    timed = stats.get("timed_choice")
    if not isinstance(timed, Mapping):
        return ""
    if timed.get("equals"):
        return f"the plan is the model's own checkpointing layout {timed['equals']!r}"
    if timed.get("skipped"):
        return f"not timed against the model's own checkpointing: {timed['skipped']}"
    ratios = ", ".join(f"{name} {ratio:.3f}" for name, ratio in timed["ratios"].items())
    kept = "the solver's schedule" if timed["chosen"] == PLAN else f"the layout {timed['chosen']!r}"
    return (
        f"timed against the model's own checkpointing ({timed['rounds']} rounds, step time "
        f"over the plan's: {ratios}): {kept} runs"
    )
