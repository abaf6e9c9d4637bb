"""The nested (multi-level) shape search keeps its time limit where one shape's op sequence
is far longer than the others'."""

from __future__ import annotations

import time
from typing import Any

import pytest

from chkpt_opt.graphs.synthetic import chain_graph
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import MemoryProfile
from chkpt_opt.solvers import get_solver
from chkpt_opt.solvers.nested import shape_search

SECONDS_PER_STEP = 5e-5
"""A simulation's pace on a 2,000-op decoder, made the pace on a small chain here."""


def test_a_shape_it_cannot_simulate_in_the_time_left_is_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a chain of 400 ops the shapes of one level run about 1,200 steps, the first prefix
    shape 80,600 (every op recomputed once per later segment): at this pace 4 s, past a
    1.5 s limit that the shapes before it leave about 1 s of. It is skipped, and so is any
    later one that would not end in time; the search returns within its limit and a second
    (a shape admitted ends near the deadline; checking the skipped ones takes a little).
    Simulated, it alone would take the search past 5 s."""
    graph = chain_graph(400, activation_bytes=1000)
    real = shape_search.simulate

    def paced(graph: Any, schedule: Schedule, **settings: Any) -> MemoryProfile:
        profile = real(graph, schedule, **settings)
        time.sleep(SECONDS_PER_STEP * len(profile.timeline))
        return profile

    monkeypatch.setattr(shape_search, "simulate", paced)
    limit_s = 1.5
    start = time.perf_counter()
    result = get_solver("nested")(graph, 20_000, time_limit_s=limit_s)
    took_s = time.perf_counter() - start
    assert result.stats["shapes_skipped_for_time"] > 0
    assert result.stats["search_cut_by_time_limit"]
    assert took_s <= limit_s + 1.0, took_s
    assert result.stats["shapes_tried"] >= 7  # the one-level shapes before it were judged
