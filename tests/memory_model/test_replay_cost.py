"""recompute_s against the simulator: the same seconds for every schedule, nested regions,
cached ops, unpacked ops and measured overheads included."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from chkpt_opt.errors import ScheduleError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.io import load_graph
from chkpt_opt.graphs.synthetic import random_dag
from chkpt_opt.memory_model.op_sequence import lower
from chkpt_opt.memory_model.replay_cost import recompute_s, recomputed_ops
from chkpt_opt.memory_model.schedule import Schedule, cacheable_ops
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.memory_model.unpack import unpack_candidates
from chkpt_opt.solvers import get_solver
from chkpt_opt.solvers.cached.local_search import neighbours
from tests.general_schedules import random_general_schedule
from tests.memory_model.test_unpack_sequence import chain_of_two

ROOT = Path(__file__).resolve().parents[2]


def _agrees(graph: CostGraph, schedule: Schedule) -> bool:
    """Whether ``schedule`` is valid (False where not) and both give the same seconds, the
    ops recomputed being those the op sequence runs again (as many times)."""
    try:
        simulated = simulate(graph, schedule).recompute_s
    except ScheduleError:
        return False
    assert recompute_s(graph, schedule) == pytest.approx(simulated, rel=1e-12, abs=1e-15)
    sequence = [step.node for step in lower(graph, schedule) if step.kind == "recompute"]
    assert Counter(recomputed_ops(graph, schedule)) == Counter(sequence)
    return True


@pytest.mark.parametrize(
    "make",
    [
        lambda: random_dag(30, seed=3, skip_prob=0.4, max_inputs=3),
        lambda: load_graph(ROOT / "graphs" / "segnet_layers.json"),
        lambda: load_graph(ROOT / "graphs" / "unet_layers.json"),
        lambda: load_graph(ROOT / "graphs" / "gpt_small.json"),
    ],
    ids=["random_dag", "segnet_layers", "unet_layers", "gpt_small"],
)
def test_it_matches_the_simulator_on_random_general_schedules(make: object) -> None:
    graph = make()  # type: ignore[operator]
    rng = random.Random(0)
    checked = unpacking = 0
    for _ in range(40):
        schedule = random_general_schedule(graph, rng)
        inside = frozenset(n for region in schedule.regions for n in region)
        candidates = unpack_candidates(graph, inside)
        picked = frozenset(c for c in candidates if rng.random() < 0.5)
        for s in (schedule, schedule.with_unpacked(picked)):
            if _agrees(graph, s):
                checked += 1
                unpacking += bool(s.unpacked)
    assert checked >= 40
    assert unpacking > 0 or not unpack_candidates(graph, frozenset())


def test_it_matches_the_simulator_on_every_neighbour_of_a_measured_graph() -> None:
    """The padded Llama of tests/data/hf_padded: measured op times, region and policy
    overheads, hooks charged for unpacked ops; every move of the cached-op search from
    greedy's schedule."""
    data = ROOT / "tests" / "data" / "hf_padded"
    graph = load_graph(data / "llama.json")
    budget = json.loads((data / "budgets.json").read_text())["llama"]
    start = get_solver("greedy")(graph, budget).schedule
    moves = list(neighbours(graph, start, cacheable_ops(graph)))
    checked = [m for m in moves if _agrees(graph, m)]
    assert len(checked) > 50
    assert any(m.saved for m in checked) and any(m.unpacked for m in checked)


def test_a_recipe_rebuilt_only_for_another_is_counted() -> None:
    """b and c unpacked on a -> b -> c -> d, d saving c: no op saves b, so b is rebuilt only
    because c's recipe needs it (2 s), before c (3 s)."""
    graph = chain_of_two()
    schedule = Schedule(unpacked=frozenset({"b", "c"}))
    assert recompute_s(graph, schedule) == simulate(graph, schedule).recompute_s == 5.0
