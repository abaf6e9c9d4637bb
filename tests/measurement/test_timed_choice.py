"""The plan against the model's own checkpointing layouts, timed (measurement.timed_choice).

The timer is injected where a test asserts which candidate wins, so that no assertion
depends on this machine's speed."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from chkpt_opt.api import plan_traced
from chkpt_opt.codegen.runtime import CheckpointRegion
from chkpt_opt.measurement import trace_and_measure
from chkpt_opt.measurement.timed_choice import (
    MIN_ROUNDS,
    PLAN,
    TIMED_ROUNDS,
    describe,
    fastest,
    fitting_layouts,
    prepare_choice,
    reserve_s,
    rounds_within,
    with_timed_choice,
)
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.own_layouts import own_layouts
from chkpt_opt.solvers import SolveStatus, get_solver

transformers = pytest.importorskip("transformers")


def _regions(module: torch.nn.Module) -> int:
    return sum(isinstance(m, CheckpointRegion) for m in module.modules())


def _slower_with_regions(module: torch.nn.Module, *_: Any) -> float:
    return 1.0 + _regions(module)


def _faster_with_regions(module: torch.nn.Module, *_: Any) -> float:
    return 1.0 / (1 + _regions(module))


@pytest.fixture(scope="module")
def llama() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 256, (2, 32))
    return trace_and_measure(model, (), {"input_ids": ids, "labels": ids}, profile_times=False)


def _greedy_above_layers(traced: Any) -> tuple[Any, int]:
    """A budget 15% above a region per layer's peak, and greedy's result there: a schedule
    other than the layout, with the layout fitting beside it."""
    graph = traced.graph
    layers = own_layouts(graph)["layers"]
    budget = int(simulate(graph, layers).peak_bytes * 1.15)
    result = get_solver("greedy")(graph, budget)
    assert result.feasible and result.schedule != layers
    return result, budget


def test_the_layouts_that_fit_are_offered_with_a_reserve(llama: Any) -> None:
    graph = llama.graph
    layouts = own_layouts(graph)
    peaks = {name: simulate(graph, s).peak_bytes for name, s in layouts.items()}
    lowest = min(peaks.values())
    assert fitting_layouts(graph, lowest - 1) == {}
    fitting = fitting_layouts(graph, lowest)
    assert fitting and all(peaks[name] <= lowest for name in fitting)
    assert reserve_s(graph, fitting, 3) < reserve_s(graph, fitting, 5)
    # a limit too short for MIN_ROUNDS rounds: no choice, nothing reserved
    assert rounds_within(graph, fitting, reserve_s(graph, fitting, MIN_ROUNDS) / 2) == 0
    assert prepare_choice(graph, lowest, time_limit_s=1e-9) == (fitting, 0, 0.0)
    assert prepare_choice(graph, lowest - 1, time_limit_s=None) == ({}, 0, 0.0)
    assert prepare_choice(graph, lowest, time_limit_s=None)[1] == TIMED_ROUNDS


def test_the_fastest_candidate_wins_and_the_plan_wins_ties(llama: Any) -> None:
    graph = llama.graph
    candidates = {PLAN: Schedule(), "layers": own_layouts(graph)["layers"]}
    slow = fastest(llama, graph, candidates, rounds=3, timer=_slower_with_regions)
    assert slow.chosen == PLAN and slow.ratios["layers"] == pytest.approx(3.0)
    fast = fastest(llama, graph, candidates, rounds=3, timer=_faster_with_regions)
    assert fast.chosen == "layers" and fast.ratios["layers"] == pytest.approx(1 / 3)
    tie = fastest(llama, graph, candidates, rounds=3, timer=lambda *_: 1.0)
    assert tie.chosen == PLAN
    with pytest.raises(ValueError, match="rounds = 0 must be >= 1"):
        fastest(llama, graph, candidates, rounds=0)


def test_a_faster_layout_replaces_the_plan_honestly(llama: Any) -> None:
    graph = llama.graph
    result, budget = _greedy_above_layers(llama)
    layouts = fitting_layouts(graph, budget)
    # greedy cuts more regions than a layer each: the timer that makes time grow with
    # the regions a module runs favours the first layout, the one that makes it fall the plan
    assert all(len(result.schedule.regions) > len(s.regions) for s in layouts.values())
    first = next(iter(layouts))
    swapped = with_timed_choice(llama, graph, result, layouts, 3, timer=_slower_with_regions)
    assert swapped.stats["timed_choice"]["chosen"] == first
    assert swapped.schedule == layouts[first]
    profile = simulate(graph, swapped.schedule)
    assert swapped.status == SolveStatus.FEASIBLE
    assert swapped.objective == profile.recompute_s
    assert swapped.peak_bytes == profile.peak_bytes <= budget
    assert swapped.bound == result.bound
    kept = with_timed_choice(llama, graph, result, layouts, 3, timer=_faster_with_regions)
    assert kept.stats["timed_choice"]["chosen"] == PLAN
    assert kept.schedule == result.schedule and kept.status == result.status


def test_timing_leaves_the_model_as_it_was(llama: Any) -> None:
    model = llama.captured.module
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rng = torch.random.get_rng_state()
    fastest(llama, llama.graph, {PLAN: Schedule(), **own_layouts(llama.graph)}, rounds=1)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert torch.equal(rng, torch.random.get_rng_state())


def test_plan_times_only_auto_on_measured_op_times(llama: Any) -> None:
    layers = own_layouts(llama.graph)["layers"]
    keep_all = plan_traced(llama, budget=10**12, optimizer=None, solver="keep_all")
    budget = keep_all.static.resident_bytes + int(simulate(llama.graph, layers).peak_bytes * 1.15)
    # roofline op times: no timed choice by default, and none for a named solver
    roofline = plan_traced(llama, budget=budget, optimizer=None, solver="greedy")
    assert "timed_choice" not in roofline.result.stats
    asked = plan_traced(llama, budget=budget, optimizer=None, solver="greedy", timed_choice=True)
    assert asked.result.stats["timed_choice"]["rounds"] == TIMED_ROUNDS
    assert asked.profile.peak_bytes <= asked.activation_budget_bytes
    assert "timed against the model's own checkpointing (5 rounds" in asked.summary()
    assert "timed against" not in roofline.summary()


def test_a_plan_timed_after_its_solve_keeps_its_budget(llama: Any) -> None:
    # what the attachment runs after each solve, beyond the solve's limit
    layers = own_layouts(llama.graph)["layers"]
    keep_all = plan_traced(llama, budget=10**12, optimizer=None, solver="keep_all")
    budget = keep_all.static.resident_bytes + int(simulate(llama.graph, layers).peak_bytes * 1.15)
    made = plan_traced(llama, budget=budget, optimizer=None, solver="greedy")
    timed = made.timed(rounds=2)
    chosen = timed.result.stats["timed_choice"]["chosen"]
    expected = (
        made.schedule
        if chosen == PLAN
        else fitting_layouts(made.graph, made.activation_budget_bytes)[chosen]
    )
    assert timed.schedule == expected
    assert timed.profile == simulate(made.graph, expected)
    assert timed.predicted_peak_bytes <= budget


def test_a_plan_that_is_the_models_own_layout_is_not_timed(llama: Any) -> None:
    graph = llama.graph
    result, _ = _greedy_above_layers(llama)
    layers = own_layouts(graph)["layers"]
    same = dataclasses.replace(result, schedule=layers)

    def never(*_: Any) -> float:
        raise AssertionError("nothing to time")

    told = with_timed_choice(llama, graph, same, {"layers": layers}, 3, timer=never)
    assert told.schedule == layers
    assert told.stats["timed_choice"]["equals"] == "layers"
    assert describe(told.stats) == "the plan is the model's own checkpointing layout 'layers'"


def test_a_choice_not_made_says_why(llama: Any) -> None:
    graph = llama.graph
    result, _ = _greedy_above_layers(llama)
    layers = own_layouts(graph)["layers"]

    def never(*_: Any) -> float:
        raise AssertionError("nothing to time")

    nothing_fits = with_timed_choice(llama, graph, result, {}, 3, timer=never)
    no_room = with_timed_choice(llama, graph, result, {"layers": layers}, 0, timer=never)
    for told in (nothing_fits, no_room):
        assert told.schedule == result.schedule
        assert told.stats["timed_choice"]["chosen"] == PLAN
    assert describe(nothing_fits.stats) == (
        "not timed against the model's own checkpointing: no layout of the model's own fits "
        "the budget"
    )
    assert "no room for 3 rounds" in describe(no_room.stats)
