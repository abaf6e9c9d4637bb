"""The overheads of regions: measured once per plan with profile_times (per region and
per tensor a replayed op saves), counted by the simulator and by every solver's model
alike."""

from __future__ import annotations

import pytest
import torch

import chkpt_opt
from chkpt_opt.codegen import overhead
from chkpt_opt.errors import GraphFormatError
from chkpt_opt.graphs.costgraph import check_graph
from chkpt_opt.graphs.synthetic import chain_graph, random_dag
from chkpt_opt.graphs.tracer import trace_model
from chkpt_opt.op_sequence import lower
from chkpt_opt.schedule import Schedule, cut_positions
from chkpt_opt.simulate import simulate
from chkpt_opt.solvers import get_solver
from tests.conftest import assert_valid_result

OVERHEAD_S = 2e-4
SAVED_TENSOR_S = 3e-5


def _with_overhead(graph, overhead_s: float = OVERHEAD_S, saved_tensor_s: float = 0.0):
    graph = graph.copy()
    graph.graph["region_overhead_s"] = overhead_s
    graph.graph["saved_tensor_overhead_s"] = saved_tensor_s
    check_graph(graph)
    return graph


def test_the_simulator_charges_every_region_once() -> None:
    plain = chain_graph(8, activation_bytes=1000)
    charged = _with_overhead(plain)
    schedule = Schedule.from_spans(plain, [(1, 3), (4, 6)])
    nested = Schedule(regions=schedule.regions, nested=(schedule.regions[0][1:],))
    for s, regions in ((Schedule(), 0), (schedule, 2)):
        assert simulate(charged, s).recompute_s == pytest.approx(
            simulate(plain, s).recompute_s + regions * OVERHEAD_S
        )
    assert simulate(charged, nested).recompute_s == pytest.approx(
        simulate(plain, nested).recompute_s + 3 * OVERHEAD_S
    )
    assert simulate(charged, schedule).peak_bytes == simulate(plain, schedule).peak_bytes


def test_the_simulator_charges_every_recompute_step_its_saved_tensors() -> None:
    plain = random_dag(14, seed=2, skip_prob=0.2, max_inputs=2)
    charged = _with_overhead(plain, 0.0, SAVED_TENSOR_S)
    cuts = [p for p, ok in enumerate(cut_positions(plain)) if ok]
    schedule = Schedule.from_spans(plain, [(cuts[1], cuts[-2])])
    replayed = [s.node for s in lower(plain, schedule) if s.kind == "recompute"]
    saved = sum(plain.nodes[v]["n_saved"] for v in replayed)
    assert saved > 0
    assert simulate(charged, schedule).recompute_s == pytest.approx(
        simulate(plain, schedule).recompute_s + saved * SAVED_TENSOR_S
    )
    assert simulate(charged, Schedule()).recompute_s == 0.0


@pytest.mark.parametrize(
    "name", ["enumerate", "cpsat", "milp", "dp_chain", "pruned", "dp_nested", "auto"]
)
def test_every_model_counts_the_overhead_as_the_simulator_does(name: str) -> None:
    graph = _with_overhead(chain_graph(10, activation_bytes=1000), saved_tensor_s=SAVED_TENSOR_S)
    keep = simulate(graph, Schedule()).peak_bytes
    for fraction in (0.8, 0.6, 0.45):
        budget = int(fraction * keep)
        result = get_solver(name)(graph, budget, time_limit_s=20)
        assert_valid_result(graph, result, budget)


def test_a_large_overhead_makes_the_optimum_use_fewer_regions() -> None:
    graph = random_dag(18, seed=4, skip_prob=0.2, max_inputs=2)
    budget = int(0.6 * simulate(graph, Schedule()).peak_bytes)
    free = get_solver("cpsat")(graph, budget, time_limit_s=20)
    assert free.proven and free.feasible and len(free.schedule.regions) > 1
    total = sum(a["fwd_time_s"] for _, a in graph.nodes(data=True))
    charged = get_solver("cpsat")(_with_overhead(graph, total), budget, time_limit_s=20)
    assert charged.proven and len(charged.schedule.regions) < len(free.schedule.regions)


@pytest.mark.parametrize("key", ["region_overhead_s", "saved_tensor_overhead_s"])
def test_bad_overheads_are_refused(key: str) -> None:
    for bad in (-1e-3, 2.0, "0.1", True, float("nan")):
        graph = chain_graph(4)
        graph.graph[key] = bad
        with pytest.raises(GraphFormatError, match=key):
            check_graph(graph)


def test_dp_nested_charges_every_region_and_nests_less_for_it() -> None:
    """On a chain whose lowest peak needs nesting, dp_nested's nested plan pays the
    overhead per region (its prediction is checked against the simulator's inside the
    solver); a large overhead makes its optimum use fewer regions, and equals a brute
    force over the plans it found."""
    graph = chain_graph(12, activation_bytes=1000)
    lowest = get_solver("dp_nested")(graph, 0, time_limit_s=20)
    budget = lowest.peak_bytes + 1500
    free = get_solver("dp_nested")(graph, budget, time_limit_s=20)
    assert free.proven and free.schedule.nested
    total = sum(a["fwd_time_s"] for _, a in graph.nodes(data=True))
    charged_graph = _with_overhead(graph, total / 4)
    charged = get_solver("dp_nested")(charged_graph, budget, time_limit_s=20)
    assert_valid_result(charged_graph, charged, budget)
    assert charged.proven
    count = len(charged.schedule.regions) + len(charged.schedule.nested)
    assert count < len(free.schedule.regions) + len(free.schedule.nested)
    # The overhead-free optimum, charged, is no cheaper than the charged optimum.
    assert charged.objective <= simulate(charged_graph, free.schedule).recompute_s + 1e-12


def test_profiled_plans_measure_the_overhead() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    made = chkpt_opt.plan(
        model, (torch.randn(8, 16),), budget=10**12, optimizer=None, profile_times=True
    )
    # Three ops, too few spans to fit on the model: one cost per region from the chain.
    assert 0.0 < made.graph.graph["region_overhead_s"] < 0.05
    assert made.graph.graph["saved_tensor_overhead_s"] == 0.0
    traced = chkpt_opt.trace(model, (torch.randn(8, 16),)).graph
    assert "region_overhead_s" not in traced and "saved_tensor_overhead_s" not in traced


class _Mlp(torch.nn.Module):
    """Eight tanh layers of width 16, a batch norm and dropout: state a measurement must
    leave as it found it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(8))
        self.norm = torch.nn.BatchNorm1d(16)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.norm(x))
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.sum()


def _traced_mlp():
    torch.manual_seed(0)
    model = _Mlp().train()
    return model, trace_model(model, (torch.randn(8, 16),), profile_times=True)


def test_the_overheads_are_measured_on_the_models_own_rewrites() -> None:
    model, traced = _traced_mlp()
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    measured = overhead.measure_model_overheads(traced)
    assert measured is not None and measured.measured_on == "model"
    assert 0.0 <= measured.region_s < 0.05 and 0.0 <= measured.saved_tensor_s < 0.05
    assert measured.region_s + measured.saved_tensor_s > 0.0
    # The model's buffers (the norm's running statistics), gradients and RNG are untouched.
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in buffers.items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_without_the_time_or_the_memory_the_chain_is_measured(monkeypatch) -> None:
    _, traced = _traced_mlp()
    assert overhead.measure_model_overheads(traced, time_limit_s=1e-6) is None
    assert overhead.measure_overheads(traced, time_limit_s=1e-6).measured_on == "chain"

    def out_of_memory(*_args, **_kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(overhead, "run_step", out_of_memory)
    assert overhead.measure_model_overheads(traced) is None


def test_the_fit_recovers_both_costs_and_keeps_them_non_negative() -> None:
    region_s, saved_s = 3e-4, 7e-5
    rows = [(r, s, r * region_s + s * saved_s) for r, s in ((178, 162), (89, 190), (45, 205))]
    fitted = overhead._fit(rows, measured_on="model")
    assert fitted.region_s == pytest.approx(region_s) and fitted.saved_tensor_s == pytest.approx(
        saved_s
    )
    # Times that fall with more regions: all of it per saved tensor, none per region.
    falling = [(r, s, 1e-3 * s - 1e-5 * r) for r, s in ((40, 10), (20, 30), (10, 60))]
    fitted = overhead._fit(falling, measured_on="model")
    assert fitted.region_s == 0.0 and fitted.saved_tensor_s > 0.0
    assert overhead._fit([(4, 2, -1.0), (2, 3, -2.0)], measured_on="chain") == (
        overhead.CheckpointOverheads(0.0, 0.0, "chain")
    )
