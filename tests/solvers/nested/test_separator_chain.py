"""dp_nested on graphs cut at their separators (solvers/nested/separator_chain.py): the bytes read
off the op sequence equal the simple chain's where both apply, the DP never counts a plan
below the simulator and counts it exactly where the chain says so, and its optimum equals
brute force over the same space on small residual graphs."""

from __future__ import annotations

import dataclasses
import random

import pytest

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import ordered_nodes, storage_owners, storages_read
from chkpt_opt.graphs.synthetic import random_dag
from chkpt_opt.graphs.tracer import trace_model
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.own_layouts import own_layouts
from chkpt_opt.solvers import SolveStatus, get_solver
from chkpt_opt.solvers.base import INF_BYTES
from chkpt_opt.solvers.nested.dp_nested import SEPARATOR_SPACE, predict
from chkpt_opt.solvers.nested.separator_chain import UNITS, separator_chain
from chkpt_opt.solvers.nested.unit_chain import Plan, plan_schedule, simple_chain
from chkpt_opt.zoo import huggingface as hf_zoo
from tests.conftest import assert_valid_result
from tests.solvers.nested.test_dp_nested import random_chain, random_unit_chain

NO_STEPS = -INF_BYTES


def _random_plan(rng: random.Random, lo: int, hi: int, depth: int) -> Plan:
    cuts = list(range(lo, hi + 1))
    picked = sorted(rng.sample(cuts, min(len(cuts), rng.randint(0, 4) * 2)))
    spans = [(a, b) for a, b in zip(picked[::2], picked[1::2]) if b > a and (a, b) != (lo, hi)]
    return tuple((a, b, _random_plan(rng, a, b, depth - 1) if depth > 1 else ()) for a, b in spans)


def test_a_simple_chain_read_off_the_op_sequence_is_the_simple_chain() -> None:
    rng = random.Random(1)
    compared = 0
    for k in range(200):
        graph = (random_unit_chain if k % 2 else random_chain)(rng.randint(3, 10), rng)
        simple = simple_chain(graph)
        if not all(simple.ok):
            continue  # a forbidden cut merges two ops into one block
        blocks = separator_chain(graph)
        for field in dataclasses.fields(simple):
            mine, theirs = getattr(blocks, field.name), getattr(simple, field.name)
            if field.name == "t_own":  # read only where the replay runs the unit
                mine = tuple(x for x, s in zip(mine, simple.sown) if s)
                theirs = tuple(x for x, s in zip(theirs, simple.sown) if s)
            if field.name == "bwd_pre":  # a view's backward before its owner's, as its own
                mine = tuple(x if x == NO_STEPS else NO_STEPS for x in mine)
            if field.name != "units":
                assert mine == theirs, (k, field.name, mine, theirs)
        assert blocks.exact
        compared += 1
    assert compared > 60


def test_the_dp_never_counts_a_plan_below_the_simulator_and_exactly_where_it_says() -> None:
    rng = random.Random(0)
    exact = loose = checked = over = pinned = 0
    for k in range(120):
        graph = random_dag(
            rng.randint(6, 20),
            seed=k,
            skip_prob=rng.choice([0.2, 0.4, 0.6]),
            max_inputs=rng.choice([2, 3]),
        )
        chain = separator_chain(graph)
        exact += chain.exact
        loose += not chain.exact
        pinned += chain.pinned_bytes > 0
        for _ in range(8):
            schedule = plan_schedule(graph, chain, _random_plan(rng, 0, chain.n, 3))
            try:
                peak, cost = predict(graph, schedule)
            except SolverError as err:  # a region that saves nothing: outside the space
                assert "saves anything" in str(err)
                continue
            profile = simulate(graph, schedule)
            assert cost == pytest.approx(profile.recompute_s, rel=1e-12, abs=1e-15)
            assert profile.peak_bytes <= peak <= profile.peak_bytes + chain.slack_bytes, k
            if chain.exact:
                assert peak == profile.peak_bytes, (k, schedule)
            over += peak > profile.peak_bytes
            checked += 1
    assert exact > 15 and loose > 20 and pinned > 40, (exact, loose, pinned)
    assert checked > 500 and over > 0, (checked, over)


def _all_plans(lo: int, hi: int, proper: bool) -> list[Plan]:
    """Every region tree on unit positions ``lo..hi`` (``proper``: not ``[lo, hi)`` itself)."""

    def from_(p: int) -> list[Plan]:
        if p >= hi:
            return [()]
        found = list(from_(p + 1))
        for q in range(p + 1, hi + 1):
            if proper and (p, q) == (lo, hi):
                continue
            for inner in _all_plans(p, q, True):
                found += [((p, q, inner), *rest) for rest in from_(q)]
        return found

    return from_(lo)


SEEDS = [0, 21, 23, 39]  # random DAGs of 9 ops whose blocks are counted exactly (4-5 units)


@pytest.mark.parametrize("seed", SEEDS)
def test_dp_optimum_equals_brute_force_over_separator_schedules(seed: int) -> None:
    graph = random_dag(9, seed=seed, skip_prob=0.5, max_inputs=2)
    chain = separator_chain(graph, broadcast=False)  # (broadcast storages: counted loosely)
    assert chain.n >= 3 and chain.exact
    profiles = []
    for plan in _all_plans(0, chain.n, False):
        schedule = plan_schedule(graph, chain, plan)
        try:
            predict(graph, schedule, broadcast=False)
        except SolverError:  # a region holding no packer: never better, outside the space
            continue
        profiles.append(simulate(graph, schedule, check=False))
    keep_all = simulate(graph, Schedule()).peak_bytes
    lowest = min(p.peak_bytes for p in profiles)
    for budget in sorted({keep_all, (keep_all + lowest) // 2, lowest, lowest - 1}):
        result = get_solver("dp_nested", block_options=False, broadcast=False)(graph, budget)
        assert_valid_result(graph, result, budget)
        assert result.stats["units"] == UNITS
        fitting = [p.recompute_s for p in profiles if p.peak_bytes <= budget]
        if budget >= keep_all:  # nothing recomputed: optimal over every schedule
            assert result.status == SolveStatus.OPTIMAL and result.objective == 0
            continue
        proof = result.stats["space_proof"]
        assert proof["over"] == SEPARATOR_SPACE
        # Its proofs hold over its space only, which leaves keep-set schedules out.
        assert result.bound is None and not result.proves_infeasible
        if fitting:
            assert result.status == SolveStatus.FEASIBLE and proof["optimal"], budget
            assert result.objective == pytest.approx(min(fitting), rel=1e-12, abs=1e-15)
            assert proof["bound_s"] == result.objective
        else:
            assert result.status == SolveStatus.INFEASIBLE and proof["infeasible"]
            assert result.peak_bytes == lowest == proof["min_peak_lower_bytes"]


@pytest.mark.parametrize(
    "seed,broadcast,proofs",
    # conservative chains of 5 and 4 blocks (inputs counted loosely), of 5 and 4 blocks
    # between separators found beside broadcast storages; whether the bound proves the
    # optimum
    [(174, False, {False}), (196, False, {True, False}), (4, True, {False}), (19, True, {False})],
)
def test_a_conservative_chain_bounds_its_optimum_with_its_slack(
    seed: int, broadcast: bool, proofs: set[bool]
) -> None:
    graph = random_dag(9, seed=seed, skip_prob=0.6, max_inputs=3)
    chain = separator_chain(graph, broadcast=broadcast)
    assert not chain.exact and chain.slack_bytes > 0
    assert (chain.pinned_bytes > 0) == broadcast
    assert chain.n > separator_chain(graph, broadcast=False).n or not broadcast
    profiles = []
    for plan in _all_plans(0, chain.n, False):
        schedule = plan_schedule(graph, chain, plan)
        try:
            predict(graph, schedule, broadcast=broadcast)
        except SolverError:
            continue
        profiles.append(simulate(graph, schedule, check=False))
    keep_all = simulate(graph, Schedule()).peak_bytes
    lowest = min(p.peak_bytes for p in profiles)
    fractions = (0.95, 0.9, 0.8, 0.7)
    statuses = set()
    assert lowest < keep_all
    for budget in sorted({*(int(f * keep_all) for f in fractions), lowest, lowest - 1}):
        solver = get_solver("dp_nested", block_options=False, broadcast=broadcast)
        result = solver(graph, budget)
        assert_valid_result(graph, result, budget)
        assert result.stats["model"] == "conservative"
        assert result.stats["slack_bytes"] == chain.slack_bytes
        fitting = [p.recompute_s for p in profiles if p.peak_bytes <= budget]
        proof = result.stats["space_proof"]
        assert result.bound is None and not result.proves_infeasible
        if result.feasible:
            best = min(fitting)
            assert proof["bound_s"] is not None and proof["bound_s"] <= best * (1 + 1e-12)
            assert result.objective >= best * (1 - 1e-12)
            if proof["optimal"]:
                assert result.objective == pytest.approx(best, rel=1e-12, abs=1e-15)
            statuses.add(proof["optimal"])
        else:
            assert proof["min_peak_lower_bytes"] <= lowest <= result.stats["min_feasible_bytes"]
            if proof["infeasible"]:
                assert not fitting
    assert statuses == proofs


def test_a_decoder_is_cut_between_its_layers_beside_its_rotary_tables() -> None:
    """A Hugging Face Llama computes its rotary tables once and every layer reads them, so
    they cross every cut between layers. Counted as broadcast storages, the cuts between
    layers and between a layer's halves separate (without: only those around the
    embedding and the head), and dp_nested nests regions over layers below the peak of
    one region per layer (what ``gradient_checkpointing_enable()`` runs), its plan judged
    against the simulator."""
    layers = 4
    model, args, _ = hf_zoo.llama(layers=layers, width=64, batch=2, seq=64)
    graph = trace_model(model, args, {}).graph
    chain = separator_chain(graph)
    plain = separator_chain(graph, broadcast=False)
    assert plain.n <= 7 and chain.n >= 2 * layers + 1, (plain.n, chain.n)
    order = ordered_nodes(graph)
    unit_of = {
        order[i]: u for u in range(chain.n) for i in range(chain.starts[u], chain.starts[u + 1])
    }
    owners = storage_owners(graph)
    for sid in chain.pinned:  # read in every layer
        readers = {unit_of[v] for v in order if sid in storages_read(graph, v, owners)}
        assert len(readers) >= layers, (sid, readers)
    assert chain.pinned_bytes == sum(
        graph.nodes[owners[sid]]["outputs"][sid] for sid in chain.pinned
    )
    per_layer = simulate(graph, own_layouts(graph)["layers"]).peak_bytes
    # (no block options: their programs would take a quarter of the limit)
    result = get_solver("dp_nested", block_options=False)(graph, per_layer - 1, time_limit_s=30)
    assert_valid_result(graph, result, per_layer - 1)
    assert result.stats["units"] == UNITS and result.stats["slack_bytes"] >= chain.pinned_bytes
    assert result.feasible and len(result.schedule.nested) > 0, result.stats
    without = get_solver("dp_nested", block_options=False, broadcast=False)
    assert not without(graph, per_layer - 1, time_limit_s=30).feasible
