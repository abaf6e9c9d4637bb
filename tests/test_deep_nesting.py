"""Schedules whose recompute regions nest deeper than Python's default recursion limit
allows (the nested solver's multi-level plans reach ~100 levels) run forward and backward,
with the model's gradients, and leave the recursion limit as it was."""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Iterator

import pytest
import torch

import chkpt_opt
from chkpt_opt import zoo
from chkpt_opt.codegen.recursion_room import (
    DEEP_LEVELS,
    FRAMES_PER_LEVEL,
    HEADROOM_FRAMES,
    recursion_room,
)
from chkpt_opt.memory_model.schedule import Schedule

DEPTH = 150  # ~1350 frames in the forward pass: past a limit of 1000


@pytest.fixture
def limit_1000() -> Iterator[None]:
    """Python's default limit, whatever the test runner set."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        yield
    finally:
        sys.setrecursionlimit(before)


def _deeply_nested(graph: object, depth: int) -> Schedule:
    """One region from each cut point to the end, each inside the one before (as in
    benchmarks/results/max_length/nested_recursion_repro.py)."""
    ops = sorted(graph.nodes, key=lambda n: graph.nodes[n]["index"])
    ok = [i for i, n in enumerate(ops) if graph.nodes[n]["cut_after_ok"]]
    starts = [i + 1 for i in ok[: depth + 1] if i + 1 < len(ops) - 2]
    assert len(starts) >= depth
    return Schedule(
        regions=(tuple(ops[starts[0] : -2]),),
        nested=tuple(tuple(ops[s:-2]) for s in starts[1:depth]),
    )


def test_a_schedule_nested_150_deep_trains_with_the_models_gradients(limit_1000: None) -> None:
    model, args, _ = zoo.mlp(width=8, depth=DEPTH + 4, batch=2)
    reference = copy.deepcopy(model)
    plan = chkpt_opt.plan(
        model, args, budget=10**12, optimizer=None, solver="keep_all", profile_times=False
    )
    schedule = _deeply_nested(plan.graph, DEPTH)
    assert len(schedule.nested) + 1 == DEPTH
    profile = chkpt_opt.simulate(plan.graph, schedule)  # a valid schedule
    result = dataclasses.replace(plan.result, schedule=schedule)
    module = dataclasses.replace(plan, result=result, profile=profile).apply()

    reference(*args).sum().backward()
    # The default limit, then one below the backward pass's chain of unpack hooks (3
    # frames per level); each time the limit is put back after the step.
    for limit in (1000, 400, 1000):
        module.zero_grad(set_to_none=True)
        sys.setrecursionlimit(limit)
        module(*args).sum().backward()
        assert sys.getrecursionlimit() == limit
        grads = {n: p.grad for n, p in module.named_parameters()}
        for name, p in reference.named_parameters():
            assert grads[name] is not None, name
            assert torch.equal(grads[name], p.grad), name


def test_the_room_holds_until_the_last_request_ends(limit_1000: None) -> None:
    with recursion_room(DEEP_LEVELS + 100):
        raised = sys.getrecursionlimit()
        assert raised > (DEEP_LEVELS + 100) * FRAMES_PER_LEVEL + HEADROOM_FRAMES
        with recursion_room(DEEP_LEVELS + 200):  # inside a roomy call: already covered
            assert sys.getrecursionlimit() == raised
    assert sys.getrecursionlimit() == 1000
    with recursion_room(DEEP_LEVELS - 1):  # shallow nesting leaves the limit alone
        assert sys.getrecursionlimit() == 1000


def test_a_limit_changed_meanwhile_is_kept(limit_1000: None) -> None:
    with recursion_room(DEEP_LEVELS + 100):
        sys.setrecursionlimit(50_000)
    assert sys.getrecursionlimit() == 50_000
