"""Planning keeps its promise: ``time_limit_s`` bounds the whole planning of a training
step (capture, op timing, solve, timed choice), and nothing chkpt_opt starts (watchdog
threads, the HiGHS child process) outlives it."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

import chkpt_opt
from chkpt_opt import api
from chkpt_opt.api import MIN_SOLVE_S, Plan
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.own_layouts import own_layouts
from chkpt_opt.solvers import SolveStatus, get_solver
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.step_budget import whole_step
from tests.attachment.tiny_models import tiny_llama
from tests.processes import child_pids, new_child_pids

transformers = pytest.importorskip("transformers")

VOCAB = 512
LIMIT_S = 10.0
SLACK_S = 5.0
STAGES = {"capture", "op timing", "solve", "timed choice"}
"""The stages of planning; the timed choice runs only on measured op times."""
RUN = {"capture", "op timing", "solve"}


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (4, 64), generator=gen)
    return {"input_ids": ids, "labels": torch.randint(0, VOCAB, (4, 64), generator=gen)}


@pytest.fixture(scope="module")
def keep_all_plan() -> Plan:
    """A 4-layer Llama's keep-all plan (the whole step with AdamW, estimated op times)."""
    return chkpt_opt.plan(
        tiny_llama(vocab=VOCAB, layers=4, max_positions=128),
        (),
        example_kwargs=_batch(),
        budget=10**12,
        solver="keep_all",
        profile_times=False,
    )


@pytest.fixture(scope="module")
def budget_bytes(keep_all_plan: Plan) -> int:
    """The whole step at 60% of the keep-all activations: no schedule is proven optimal
    within the limit there (the full solve takes longer)."""
    activations = int(0.6 * simulate(keep_all_plan.graph, Schedule()).peak_bytes)
    return keep_all_plan.static.step_peak_bytes(activations)


def _promised_s(limit_s: float, planning: dict[str, float]) -> float:
    """What planning may take: the limit, or where the capture (which nothing cuts short)
    took it, the capture and the solver's least time (op timing is then skipped); plus
    the slack for judging results and for the load of a shared machine."""
    return max(limit_s, planning["capture"] + MIN_SOLVE_S) + SLACK_S


def _new_threads(before: set[threading.Thread]) -> list[str]:
    """Threads alive now that were not before, but tqdm's monitor (a daemon that tqdm starts
    with its first progress bar, one of which torch.export's capture shows, and keeps)."""
    return [
        t.name
        for t in threading.enumerate()
        if t not in before and t.is_alive() and t.name != "tqdm_monitor"
    ]


def test_plan_returns_within_its_limit_and_leaves_nothing_running(budget_bytes: int) -> None:
    model = tiny_llama(vocab=VOCAB, layers=4, max_positions=128)
    before, children = set(threading.enumerate()), child_pids()
    start = time.perf_counter()
    made = chkpt_opt.plan(
        model, (), example_kwargs=_batch(), budget=budget_bytes, time_limit_s=LIMIT_S
    )
    elapsed = time.perf_counter() - start
    assert made.result.status != SolveStatus.OPTIMAL  # the full solve would take longer
    assert elapsed <= _promised_s(LIMIT_S, made.result.stats["planning_s"]), made.result.stats
    assert not _new_threads(before) and not new_child_pids(children)
    planning: dict[str, Any] = made.result.stats["planning_s"]
    assert RUN <= set(planning) <= STAGES
    assert sum(planning.values()) <= elapsed + 0.1


def test_the_first_training_step_plans_within_the_limit_and_leaves_nothing_running(
    budget_bytes: int, caplog: pytest.LogCaptureFixture
) -> None:
    model = chkpt_opt.optimize(
        tiny_llama(vocab=VOCAB, layers=4, max_positions=128),
        budget=budget_bytes,
        time_limit_s=LIMIT_S,
    )
    attachment = chkpt_opt.attachment_of(model)
    optimizer = torch.optim.AdamW(model.parameters())
    before, children = set(threading.enumerate()), child_pids()
    with caplog.at_level("INFO", logger="chkpt_opt"):
        model(**_batch()).loss.backward()
        optimizer.step()
    stats = attachment.stats
    assert stats.solves == 1
    assert attachment.stats.prepare_s <= _promised_s(LIMIT_S, stats.planning_s), stats
    assert RUN <= set(stats.planning_s) <= STAGES
    assert sum(attachment.stats.planning_s.values()) <= attachment.stats.prepare_s
    assert not _new_threads(before) and not new_child_pids(children)
    for name in stats.planning_s:  # progress at INFO: each stage started and finished
        assert f"planning: {name} started" in caplog.text
        assert f"planning: {name} finished in" in caplog.text


def test_a_solve_cut_short_by_the_stages_before_it_falls_back_to_the_lowest_peak(
    keep_all_plan: Plan, budget_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under load the capture can take the whole limit; a solve left 1 s that finds nothing
    is no proof that nothing fits: the lowest-peak schedule is taken where it fits."""
    keep_all = get_solver("keep_all")  # what a solve left no time may return: no fit
    monkeypatch.setattr(api, "get_solver", lambda name, **settings: keep_all)
    monkeypatch.setattr(api, "fitting_layouts", lambda graph, budget_bytes: {})  # none fits
    made = api.plan_traced(
        keep_all_plan.traced, budget=budget_bytes, timed_choice=False, deadline=Deadline.after(0.0)
    )
    assert made.result.feasible and made.result.stats["chosen"] == "smallest_peak"
    assert made.result.stats["solve_cut_short"] == "infeasible"
    assert made.static.step_peak_bytes(made.profile.peak_bytes) <= budget_bytes


def test_a_refusal_after_a_solve_cut_short_searches_the_lowest_peak_once(
    keep_all_plan: Plan, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lowest-peak search that found nothing fitting is the one the refusal's message
    states: it is not run a second time (each takes at least MIN_SOLVE_S)."""
    keep_all = get_solver("keep_all")
    monkeypatch.setattr(api, "get_solver", lambda name, **settings: keep_all)
    monkeypatch.setattr(api, "fitting_layouts", lambda graph, budget_bytes: {})
    searches: list[int] = []

    def counted(graph: Any, **settings: Any) -> Any:
        searches.append(graph.number_of_nodes())
        return keep_all(graph, 0)  # the lowest peak it "finds": keep-all's, over the budget

    monkeypatch.setattr(api, "smallest_peak", counted)
    monkeypatch.setattr(whole_step, "smallest_peak", counted)
    over = keep_all_plan.static.step_peak_bytes(
        simulate(keep_all_plan.graph, Schedule()).peak_bytes
    )
    with pytest.raises(chkpt_opt.InfeasibleBudgetError) as refused:
        api.plan_traced(
            keep_all_plan.traced, budget=over - 1, timed_choice=False, deadline=Deadline.after(0.0)
        )
    assert len(searches) == 1
    assert refused.value.min_feasible_bytes == over


def test_a_solve_that_finds_nothing_in_its_time_takes_the_models_own_layers_where_they_fit(
    keep_all_plan: Plan, budget_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan is never worse than the line the model already has: where the solve found
    nothing and a region per layer fits, that layout is the plan (at once, no search)."""
    keep_all = get_solver("keep_all")
    monkeypatch.setattr(api, "get_solver", lambda name, **settings: keep_all)
    layers = own_layouts(keep_all_plan.graph)["layers"]
    assert (
        keep_all_plan.static.step_peak_bytes(simulate(keep_all_plan.graph, layers).peak_bytes)
        <= budget_bytes
    )
    for deadline in (Deadline.after(0.0), Deadline.after(None)):
        made = api.plan_traced(
            keep_all_plan.traced, budget=budget_bytes, timed_choice=False, deadline=deadline
        )
        assert made.result.feasible and made.result.stats["chosen"] == "own layout: layers"
        assert made.schedule == layers and made.result.stats["solve_cut_short"] == "infeasible"
