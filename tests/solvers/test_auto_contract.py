"""auto's contract: its result is never worse than any registered solver run alone on the
same graph, budget and time limit (cheaper while fitting; where nothing fits, a peak no
higher), over fuzzed graphs and the corpus."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.io import load_graph
from chkpt_opt.graphs.synthetic import chain_graph, random_dag
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers import get_solver
from chkpt_opt.solvers.registry import available_solvers
from tests.conftest import REL, assert_valid_result

CORPUS = Path(__file__).resolve().parents[2] / "graphs"
HF_PADDED = Path(__file__).resolve().parents[1] / "data" / "hf_padded"
"""Hugging Face graphs with measured op times and the peaks of the models' own checkpointing
(``python benchmarks/hf_graphs.py``)."""
TIME_LIMIT_S = 10.0


def _loser(
    graph: CostGraph,
    fraction: float,
    time_limit_s: float,
    *,
    budget_bytes: int | None = None,
    solvers: tuple[str, ...] | None = None,
) -> list[str]:
    """The solvers (every registered one, or ``solvers``) that, run alone, beat auto on
    ``graph`` at ``fraction`` of its keep-all peak, or at ``budget_bytes`` (none when the
    contract holds)."""
    budget = budget_bytes or int(fraction * simulate(graph, Schedule()).peak_bytes)
    auto = get_solver("auto")(graph, budget, time_limit_s=time_limit_s)
    assert_valid_result(graph, auto, budget)
    beaten = []
    for name in solvers or sorted(available_solvers()):
        if name == "auto":
            continue
        try:
            alone = get_solver(name)(graph, budget, time_limit_s=time_limit_s)
        except SolverError:
            continue  # the solver refuses this graph
        if alone.feasible and (
            not auto.feasible or auto.objective > alone.objective * (1 + REL) + 1e-15
        ):
            beaten.append(f"{name}: {alone.objective:.6g} s against {auto.objective:.6g} s")
        elif not alone.feasible and not auto.feasible and alone.peak_bytes < auto.peak_bytes:
            beaten.append(f"{name}: peak {alone.peak_bytes} B against {auto.peak_bytes} B")
    return beaten


def _chain16() -> CostGraph:
    return chain_graph(16, activation_bytes=[(k % 3 + 1) << 10 for k in range(16)])


CASES = {
    # milp_cached alone was 9% cheaper than auto here before auto ran it.
    ("dag24_s4", 0.6): lambda: random_dag(24, seed=4),
    ("chain16", 0.8): _chain16,
    ("chain16", 0.45): _chain16,
    # cached and milp_cached alone 6.04% of the step, auto 4.06% (the staged program, proven)
    ("segnet_layers", 0.6): lambda: load_graph(CORPUS / "segnet_layers.json"),
}


@pytest.mark.parametrize(("name", "fraction"), sorted(CASES))
def test_auto_is_never_worse_than_a_solver_alone(name: str, fraction: float) -> None:
    assert _loser(CASES[name, fraction](), fraction, TIME_LIMIT_S) == []


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.8, 0.6, 0.45])
@pytest.mark.parametrize(
    "name", ["vgg_small", "mlp_small", "resnet_small", "encoder_small", "gpt_small"]
)
def test_auto_is_never_worse_than_a_solver_alone_on_the_corpus(name: str, fraction: float) -> None:
    assert _loser(load_graph(CORPUS / f"{name}.json"), fraction, 30.0) == []


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(8))
def test_auto_is_never_worse_than_a_solver_alone_on_fuzzed_dags(seed: int) -> None:
    graph = random_dag(12 + 2 * seed, seed=seed, skip_prob=0.3, max_inputs=3)
    for fraction in (0.8, 0.6, 0.45):
        assert _loser(graph, fraction, TIME_LIMIT_S) == [], fraction


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_auto_is_never_worse_than_the_keep_set_solvers_on_hugging_face_graphs(
    family: str,
) -> None:
    """At the peak of the model's own checkpointing, 40 s each. At 20 s, auto returned 32%
    more recompute than the block search alone on BERT (its sweeps ran one block after
    another, and the pruned search gave them 35% of the limit) and 4% more on Llama (whose
    34 million-term program the pruned search built and never solved). Each solver here is
    cut by the limit, so the margin auto leaves the block search must hold on a loaded
    machine too: 40 s leaves it twice what it needs on 2 shared cores. Since auto runs the
    block search first (on Llama to the whole limit, its program being too large to build),
    the contract held at 20 s too where the machine was not loaded much beyond its cores
    (benchmarks/results/hf_contract/), but the block search still has 2-4 s less than
    alone, and on Llama it needs about 15 s of 20 for its schedule (17 s under a load of
    5, where auto returned 12.6% more): not a margin a test can hold on a shared
    machine. The cached-op search alone is left out: on Llama it beats auto at 20 s
    (30.48 ms against 30.90 at 95593fa; docs/limits.md, "auto's time limit")."""
    graph = load_graph(HF_PADDED / f"{family}.json")
    budget = json.loads((HF_PADDED / "budgets.json").read_text())[family]
    keep_set = ("hierarchical", "pruned", "greedy")
    assert _loser(graph, 0.0, 40.0, budget_bytes=budget, solvers=keep_set) == []


@pytest.mark.slow
def test_below_the_keep_set_floor_auto_gives_the_nested_searches_the_time() -> None:
    """No keep-set schedule fits gpt_small at 0.29 of its keep-all peak. With the keep-set
    stages at 90% of the limit the nested heuristic had a few seconds at the end; on
    Hugging Face graphs halfway to their floor auto returned 45 times (Llama) what the
    nested heuristic alone found, or nothing that fits (Mixtral; NO_FIT_KEEP_SET_SHARE)."""
    graph = load_graph(CORPUS / "gpt_small.json")
    assert _loser(graph, 0.29, 20.0, solvers=("nested", "dp_nested", "greedy")) == []
