"""Shared fixtures and checks: real models in plain torch (from chkpt_opt.zoo) at test
sizes, the validity check of a solver result, budgets between two peaks of a model."""

from __future__ import annotations

import dataclasses
import os
import random
from typing import Any

import pytest
import torch

import chkpt_opt
from chkpt_opt import zoo
from chkpt_opt.api import smallest_peak
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.memory_model.schedule import check_schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers import SolveResult, SolveStatus, get_solver
from chkpt_opt.step_budget.whole_step import activation_budget

REL = 1e-9  # relative tolerance on compute costs (sums of floats in different orders)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _threads() -> None:
    # Under pytest-xdist (``-n``) the workers share the cores: one thread each.
    torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


# Test-size versions of the reference models: small enough for CPU tests, large enough
# that activations dominate and every structure (attention, residuals, batch norm, long
# skips, dropout) is present.
MODELS = {
    "gpt": lambda: zoo.gpt(n_layer=3, d_model=64, n_head=4, seq_len=64, batch=4, vocab=256),
    "resnet": lambda: zoo.resnet(widths=(8, 16), blocks_per_stage=2, image=16, batch=4),
    "unet": lambda: zoo.unet(base=4, depth=2, image=16, batch=2),
    "hf_gpt2": lambda: zoo.hf_gpt2(n_layer=2, d_model=64, n_head=4, seq_len=32, batch=2, vocab=128),
}


def assert_valid_result(
    graph: CostGraph,
    result: Any,
    budget: int,
    *,
    rel: float = REL,
    abs_objective: float = 1e-15,
    abs_bound: float = 1e-15,
) -> None:
    """The one validity check of a solver result: a valid schedule, numbers that agree with
    the simulator, a status that agrees with the budget, an honest bound and proof flags.

    ``rel`` and the ``abs_*`` tolerances allow for sums of the same floats in other orders.
    """
    name = getattr(result, "solver", "?")
    assert isinstance(result, SolveResult), name
    assert isinstance(result.status, SolveStatus), name
    check_schedule(graph, result.schedule)
    profile = simulate(graph, result.schedule)
    assert profile.peak_bytes == result.peak_bytes, (name, result.peak_bytes, profile.peak_bytes)
    assert profile.recompute_s == pytest.approx(result.objective, rel=rel, abs=abs_objective), name
    assert result.budget_bytes == budget, name
    assert result.objective >= 0 and result.solve_s >= 0, name
    if result.status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE):
        assert profile.peak_bytes <= budget, (name, result.status, profile.peak_bytes, budget)
    else:  # infeasible / timed out: nothing found fits, so what is returned does not fit
        assert profile.peak_bytes > budget, (name, result.status, profile.peak_bytes, budget)
    if result.bound is not None:
        assert result.feasible, (name, "a bound without a feasible schedule")
        assert result.bound <= result.objective * (1 + rel) + abs_bound, (name, result.bound)
    if result.gap is not None:
        assert 0.0 <= result.gap <= 1.0, (name, result.gap)
    if result.proves_infeasible:
        assert result.status == SolveStatus.INFEASIBLE, name


def deep_chain_at_three_quarters() -> tuple[torch.nn.Module, torch.Tensor, CostGraph, int, int]:
    """The issue's deep chain (32 x ``Linear(256, 256)`` + ReLU, batch 4096): its model,
    input, cost graph, resident bytes (parameters and input) and the whole-step budget at
    three quarters of its smallest keep-set step budget."""
    model, (x,), _ = zoo.relu_chain(width=256, depth=32, batch=4096)
    graph = chkpt_opt.trace(model, (x,))
    keep_set_min = get_solver("auto", general=False)(graph, 0, time_limit_s=30).peak_bytes
    static = chkpt_opt.plan(model, (x,), budget=10**12, optimizer=None, profile_times=False).static
    resident = static.param_bytes + static.input_bytes
    return model, x, graph, resident, int(0.75 * (keep_set_min + resident))


def smallest_plan(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    *,
    time_limit_s: float,
) -> chkpt_opt.Plan:
    """The plan of the lowest peak the solvers find (no optimizer), with that peak as its
    budget: the plan at the smallest budget, without solving a second time there."""
    full = chkpt_opt.plan(
        model, args, example_kwargs=kwargs, budget=10**15, optimizer=None, profile_times=False
    )
    lowest = smallest_peak(full.graph, time_limit_s=time_limit_s)
    total = full.static.resident_bytes + lowest.peak_bytes
    budget, static, act = activation_budget(full.graph, total, optimizer=None)
    return dataclasses.replace(
        full,
        result=lowest,
        budget=budget,
        static=static,
        activation_budget_bytes=act,
        profile=simulate(full.graph, lowest.schedule),
    )


def budget_at(model: torch.nn.Module, args: tuple[Any, ...], fraction: float) -> int:
    """A whole-step budget (no optimizer) of the resident bytes plus ``fraction`` of the
    store-everything forward/backward peak."""
    full = chkpt_opt.plan(
        model, args, budget=10**15, optimizer=None, solver="keep_all", profile_times=False
    )
    return full.static.resident_bytes + int(full.profile.peak_bytes * fraction)


def random_interval_choice(model: Any, rng: random.Random) -> list[int]:
    """Disjoint candidate intervals of an interval model, drawn at random (each interval
    starting at a position as likely as any other: cache columns included)."""
    by_start: dict[int, list[int]] = {}
    for k, iv in enumerate(model.intervals):
        by_start.setdefault(iv.start, []).append(k)
    chosen, p = [], 0
    while p < model.n_ops:
        options = by_start.get(p, [])
        if options and rng.random() < 0.5:
            k = rng.choice(options)
            chosen.append(k)
            p = model.intervals[k].stop
        else:
            p += 1
    return chosen
