"""The simulator's semantics, pinned on hand-computed timelines, and its invariants."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chkpt_opt.errors import ScheduleError
from chkpt_opt.graphs.synthetic import chain_graph, random_dag
from chkpt_opt.memory_model.op_sequence import lower
from chkpt_opt.memory_model.schedule import Schedule, check_schedule, cut_positions
from chkpt_opt.memory_model.simulate import simulate


def _steps(profile):
    return [(p.kind, p.node, p.during_bytes, p.after_bytes) for p in profile.timeline]


def test_keep_all_chain_timeline_by_hand() -> None:
    # n0 -> n1 -> n2 -> n3, 100 bytes each; n_i saves its input (n0 saves nothing).
    g = chain_graph(4, activation_bytes=100)
    assert _steps(simulate(g, Schedule())) == [
        ("fwd", "n0", 100, 100),
        ("fwd", "n1", 200, 200),
        ("fwd", "n2", 300, 300),
        ("fwd", "n3", 400, 400),
        ("bwd_start", "", 500, 500),  # the caller's output gradient
        ("bwd", "n3", 600, 500),  # grad of n2 created; n2 (saved by n3) freed
        ("bwd", "n2", 600, 400),
        ("bwd", "n1", 500, 300),
        ("bwd", "n0", 300, 200),  # output and its gradient stay until the end
    ]


def test_region_timeline_by_hand() -> None:
    g = chain_graph(4, activation_bytes=100, fwd_time_s=[1.0, 2.0, 4.0, 8.0])
    profile = simulate(g, Schedule(regions=(("n1", "n2"),)))
    # n1's output is not kept (n2 is in the same region); n0 is the region's input and is
    # kept. n2 saves only its input, so recomputation stops before running n2: only n1 runs.
    assert _steps(profile) == [
        ("fwd", "n0", 100, 100),
        ("fwd", "n1", 200, 200),
        ("fwd", "n2", 300, 200),
        ("fwd", "n3", 300, 300),
        ("bwd_start", "", 400, 400),
        ("bwd", "n3", 500, 400),
        ("recompute", "n1", 500, 500),
        ("bwd", "n2", 600, 400),
        ("bwd", "n1", 500, 300),
        ("bwd", "n0", 300, 200),
    ]
    assert profile.recompute_s == 2.0
    assert profile.compute_s == pytest.approx(15.0 + 2 * 15.0 + 2.0)


def test_recompute_runs_last_op_when_it_saves_its_own_output() -> None:
    g = chain_graph(4, activation_bytes=100, saves="output", fwd_time_s=[1.0, 2.0, 4.0, 8.0])
    profile = simulate(g, Schedule(regions=(("n1", "n2"),)))
    replayed = [p.node for p in profile.timeline if p.kind == "recompute"]
    assert replayed == ["n1", "n2"]
    assert profile.recompute_s == 6.0


def test_recompute_lowers_the_peak_of_a_long_chain() -> None:
    g = chain_graph(16, activation_bytes=1000)
    keep = simulate(g, Schedule()).peak_bytes
    regions = Schedule.from_spans(g, [(1, 5), (5, 9), (9, 13)])
    assert simulate(g, regions).peak_bytes < keep


def test_invalid_schedules_are_refused() -> None:
    g = chain_graph(6)
    with pytest.raises(ScheduleError, match="not in graph"):
        simulate(g, Schedule(regions=(("n1", "nope"),)))
    with pytest.raises(ScheduleError, match="consecutive"):
        simulate(g, Schedule(regions=(("n1", "n3"),)))
    with pytest.raises(ScheduleError, match="overlaps"):
        simulate(g, Schedule(regions=(("n1", "n2"), ("n2", "n3"))))
    g.nodes["n2"]["cut_after_ok"] = False
    with pytest.raises(ScheduleError, match="cannot be split"):
        simulate(g, Schedule(regions=(("n1", "n2"),)))


def _random_schedule(g, rng: random.Random) -> Schedule:
    ok = cut_positions(g)
    cuts = sorted(rng.sample([p for p in range(len(ok)) if ok[p]], k=min(6, sum(ok))))
    spans = [(a, b) for a, b in zip(cuts[::2], cuts[1::2]) if b > a]
    return Schedule.from_spans(g, spans)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 40), seed=st.integers(0, 10_000))
def test_invariants_on_random_dags(n: int, seed: int) -> None:
    g = random_dag(n, seed=seed)
    schedule = _random_schedule(g, random.Random(seed))
    check_schedule(g, schedule)
    base = simulate(g, Schedule())
    profile = simulate(g, schedule)
    # What is left at the end (outputs, their gradients, parameter gradients) does not
    # depend on the schedule; nothing leaks.
    assert profile.timeline[-1].after_bytes == base.timeline[-1].after_bytes
    # Every allocated instance is freed at most once and never before it exists.
    alive: set[str] = set()
    for step in lower(g, schedule):
        alive.update(inst for inst, _ in step.alloc)
        for inst in step.free:
            assert inst in alive
            alive.remove(inst)
    # The extra compute is exactly the forward time of the replayed ops.
    replayed = sum(g.nodes[p.node]["fwd_time_s"] for p in profile.timeline if p.kind == "recompute")
    assert profile.recompute_s == pytest.approx(replayed)
    assert profile.peak_bytes == max(p.during_bytes for p in profile.timeline)
    assert base.recompute_s == 0.0
