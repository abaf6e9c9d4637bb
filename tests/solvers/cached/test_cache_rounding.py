"""The cached-op rounding of the recompute bound's LP: valid schedules that fit where the
keep-set rounding does not, run by codegen as predicted, and a start ``auto`` never does
worse than."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from chkpt_opt.graphs.io import load_graph
from chkpt_opt.graphs.synthetic import random_dag
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers import auto, get_solver
from chkpt_opt.solvers.auto import keep_set
from chkpt_opt.solvers.bounds.recompute_bound import recompute_bound
from chkpt_opt.solvers.cached.cache_rounding import cache_rounding
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.solvers.keepset.bound_rounding import bound_rounding
from tests.conftest import assert_valid_result

CORPUS = Path(__file__).resolve().parents[3] / "graphs"


@pytest.mark.parametrize("name", ["gpt_small", "vit_small", "resnet_small", "unet_small"])
def test_rounded_schedules_are_valid_and_judged_by_the_simulator(name: str) -> None:
    graph = load_graph(CORPUS / f"{name}.json")
    keep_all = simulate(graph, Schedule()).peak_bytes
    for fraction in (0.9, 0.7, 0.5):
        budget = int(fraction * keep_all)
        result = cache_rounding(graph, budget)
        assert_valid_result(graph, result, budget)
        assert result.bound is None  # a heuristic claims no bound


def test_the_rounding_reads_a_bound_it_is_given_and_stops_at_its_deadline() -> None:
    graph = random_dag(40, seed=3, skip_prob=0.3, max_inputs=3)
    budget = int(0.6 * simulate(graph, Schedule()).peak_bytes)
    relaxed = recompute_bound(graph, budget)
    given = cache_rounding(graph, budget, relaxed=relaxed)
    again = cache_rounding(graph, budget)  # deterministic, the same LP
    assert (given.schedule, given.objective) == (again.schedule, again.objective)
    expired = cache_rounding(graph, budget, relaxed=relaxed, deadline=Deadline.after(0.0))
    assert expired.stats["schedules"] == 0
    assert expired.schedule == Schedule()


@pytest.fixture(scope="module")
def small_llama() -> tuple:
    pytest.importorskip("transformers")
    from chkpt_opt.api import plan
    from chkpt_opt.zoo import huggingface as hf_zoo

    model, args, _ = hf_zoo.llama(layers=3, width=64, batch=2, seq=64)
    base = plan(model, args, budget=10**15, optimizer=None, solver="keep_all", profile_times=False)
    return model, args, base


def test_on_a_llama_it_caches_where_keep_set_rounding_does_not_fit(small_llama: tuple) -> None:
    """At 65% of the keep-all peak of a 3-layer Llama, no keep-set rounding fits; regions
    that cache the ops the LP keeps (the matmuls) do."""
    _, _, base = small_llama
    graph = base.graph
    budget = int(0.65 * simulate(graph, Schedule()).peak_bytes)
    assert not bound_rounding(graph, budget).feasible
    result = cache_rounding(graph, budget)
    assert result.feasible and result.schedule.saved
    assert_valid_result(graph, result, budget)
    found = get_solver("auto")(graph, budget, time_limit_s=10)
    assert found.feasible and found.objective <= result.objective * (1 + 1e-9)


def test_auto_rounds_before_a_keep_set_stage_that_takes_its_whole_share(
    small_llama: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rounding reads only the recompute bound, so ``auto`` runs it before the keep-set
    stages: an exact stage that runs to its deadline leaves it its time (after them, it had
    half a second of a 10 s limit on a loaded machine, and auto returned a costlier plan
    than the rounding's own)."""
    _, _, base = small_llama
    graph = base.graph
    budget = int(0.65 * simulate(graph, Schedule()).peak_bytes)
    rounded = cache_rounding(graph, budget)
    real = keep_set.get_solver

    def slow_exact(graph, budget_bytes: int, *, time_limit_s: float | None = None):
        time.sleep(time_limit_s or 0.0)  # the whole share, as a cut exact solver does
        return real("greedy")(graph, budget_bytes)

    monkeypatch.setattr(keep_set, "pick_exact", lambda graph, **_: ["slow_exact"])
    # the bound in integers would prove the staged rounding's plan here, and auto would
    # return before either rounding of the cached ops
    monkeypatch.setattr(auto, "with_integer_bound", lambda graph, budget, cover, _: cover)
    monkeypatch.setattr(
        keep_set,
        "get_solver",
        lambda name, **kw: slow_exact if name == "slow_exact" else real(name, **kw),
    )
    found = auto.AutoSolver()(graph, budget, time_limit_s=4)
    assert found.feasible and found.objective <= rounded.objective * (1 + 1e-9)
    assert "cache_rounding#0" in found.stats["tried"]


@pytest.mark.parametrize(
    "family, size",
    [
        ("llama", {"layers": 4, "width": 256, "batch": 2, "seq": 128}),
        ("t5", {"layers": 4, "width": 64, "batch": 2, "seq": 64}),
    ],
)
def test_it_recomputes_no_more_than_the_models_own_checkpointing(family: str, size: dict) -> None:
    """At the peak of each of a Hugging Face model's own layouts, a region per layer
    (``gradient_checkpointing_enable()``) and that region caching its matmuls (selective
    activation checkpointing), the rounding fits and recomputes no more than the layout
    does, in the same cost model. Before the model's layers were a layout of their own and
    the cached prefixes were bisected, the Llama's rounding recomputed 1.56 times what
    selective checkpointing does, and the T5's (whose first blocks differ from the rest,
    so it has no repeated blocks) had no layer layout at all."""
    pytest.importorskip("transformers")
    from chkpt_opt.api import plan
    from chkpt_opt.own_layouts import own_layouts
    from chkpt_opt.zoo import huggingface as hf_zoo

    model, args, _ = hf_zoo.FAMILIES[family](**size)
    graph = plan(model, args, budget=10**15, optimizer=None, solver="keep_all").graph
    layouts = own_layouts(graph)
    assert len(layouts["layers"].regions) == size["layers"]
    assert layouts["layers, matmuls cached"].saved
    for name, layout in layouts.items():
        own = simulate(graph, layout)
        result = cache_rounding(graph, own.peak_bytes)
        assert result.feasible, name
        assert result.objective <= own.recompute_s * (1 + 1e-9), (name, result.stats)


def test_a_rounded_llama_schedule_runs_as_predicted(small_llama: tuple) -> None:
    import dataclasses

    from chkpt_opt.validation import validate

    model, args, base = small_llama
    graph = base.graph
    budget = int(0.65 * simulate(graph, Schedule()).peak_bytes)
    result = cache_rounding(graph, budget)
    made = dataclasses.replace(
        base,
        result=result,
        activation_budget_bytes=budget,
        profile=simulate(graph, result.schedule),
    )
    report = validate(
        model, made.apply(), args, predicted_peak_bytes=made.profile.peak_bytes, repeats=1
    )
    assert report.grads_bitwise_equal and report.outputs_bitwise_equal
    assert (
        abs(report.measured_peak_bytes - made.profile.peak_bytes)
        <= 0.03 * report.measured_peak_bytes
    )


def test_the_summary_says_what_a_schedule_beyond_keep_set_beat() -> None:
    """A result from beyond keep-set carries only the recompute bound's gap; the summary
    line also says how much cheaper it is than the keep-set result, and whether that one
    was proven optimal (the quickstart's plan: 0.02% below a proven keep-set optimum)."""
    import dataclasses

    from chkpt_opt.api.solved_plan import _beyond_keep_set_note

    graph = load_graph(CORPUS / "gpt_small.json")
    budget = int(0.8 * simulate(graph, Schedule()).peak_bytes)
    result = get_solver("greedy")(graph, budget)
    assert result.feasible and result.objective > 0
    assert _beyond_keep_set_note(result) == ""
    keep = {"status": "optimal", "objective_s": result.objective * 1.25}
    beyond = dataclasses.replace(result, stats={**result.stats, "keep_set": keep})
    note = _beyond_keep_set_note(beyond)
    assert "20.00% cheaper than the proven optimal keep-set schedule" in note
    keep["status"] = "feasible"
    assert "cheaper than the keep-set schedule" in _beyond_keep_set_note(beyond)
    # Where no keep-set schedule fits, its result's objective compares with nothing (a
    # Llama with a padding mask at 100 MB was "-265.60% cheaper" than it).
    keep.update(status="infeasible", objective_s=result.objective * 0.2)
    note = _beyond_keep_set_note(beyond)
    assert "no keep-set schedule fits" in note and "cheaper" not in note
