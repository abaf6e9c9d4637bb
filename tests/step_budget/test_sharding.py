"""Per-rank budgets of sharded training: the arithmetic of chkpt_opt.step_budget.sharding in exact
bytes, the errors for bad values, and the sharding read off wrapped models."""

from __future__ import annotations

import copy
import math
import tempfile
from fractions import Fraction

import pytest
import torch

import chkpt_opt
from chkpt_opt.errors import BudgetError
from chkpt_opt.step_budget.budget import optimizer_spec, parse_budget, split_budget
from chkpt_opt.step_budget.sharding import (
    Sharding,
    per_rank_graph,
    rank_static_memory,
    sharding_of,
    unit_param_bytes,
)
from chkpt_opt.step_budget.whole_step import activation_budget, simulate_step, solve

F32 = 4
ROOT_ELEMENTS = (8 * 16 + 16) + (16 * 4 + 4)  # embedding-like input layer and head
LAYER_ELEMENTS = 16 * 16 + 16
HEAD_ELEMENTS = 16 * 4 + 4


class _Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


@pytest.fixture(scope="module")
def graph() -> chkpt_opt.CostGraph:
    torch.manual_seed(0)
    return chkpt_opt.trace(_Stack(), (torch.randn(32, 8),))


def test_units_are_the_root_then_one_per_layer(graph: chkpt_opt.CostGraph) -> None:
    assert unit_param_bytes(graph) == (ROOT_ELEMENTS * F32, *[LAYER_ELEMENTS * F32] * 3)
    assert graph.graph["param_elements"] == ROOT_ELEMENTS + 3 * LAYER_ELEMENTS


def test_fsdp2_rank_memory_in_exact_bytes(graph: chkpt_opt.CostGraph) -> None:
    params = (ROOT_ELEMENTS + 3 * LAYER_ELEMENTS) * F32
    adamw = optimizer_spec("adamw")
    s = rank_static_memory(graph, Sharding(world_size=4), adamw, foreach=True)
    shard = math.ceil(params / 4)
    root, layer = ROOT_ELEMENTS * F32, LAYER_ELEMENTS * F32
    assert s.param_bytes == shard
    assert s.optimizer_state_bytes == 2 * shard + 4 * 10  # two states, a step counter per tensor
    assert s.grad_bytes == s.resident_grad_bytes == shard
    # FSDP2's part peaks in the middle layer's backward: the root's parameters and the
    # head's gradients, the layer's parameters and gradients, the layer before gathered
    # ahead, the reduce-scatter input of the layer after (fsdp2_timeline)
    assert s.communication_bytes == root + HEAD_ELEMENTS * F32 + 4 * layer
    assert s.optimizer_step_extra_bytes == shard  # foreach: one copy of the rank's shard
    assert s.optimizer_phase_bytes == shard  # the gradients are resident already
    assert (s.world_size, s.strategy) == (4, "fsdp2")
    assert s.resident_bytes == s.param_bytes + 3 * shard + 40 + s.communication_bytes + (
        s.buffer_bytes + s.input_bytes
    )


def test_fsdp2_without_resharding_keeps_every_layer_unsharded(graph: chkpt_opt.CostGraph) -> None:
    s = rank_static_memory(graph, Sharding(world_size=4, reshard_after_forward=False), None)
    root, layer = ROOT_ELEMENTS * F32, LAYER_ELEMENTS * F32
    # the last layer's backward: the root and every layer unsharded, the head's gradients
    # and the layer's own
    assert s.communication_bytes == root + HEAD_ELEMENTS * F32 + 4 * layer
    assert s.optimizer_state_bytes == 0


def test_master_weights_scale_the_sharded_states(graph: chkpt_opt.CostGraph) -> None:
    """fp64 master weights of an fp32 trace: the states double, the unsharded units do
    not."""
    params = (ROOT_ELEMENTS + 3 * LAYER_ELEMENTS) * F32
    sharding = Sharding(world_size=8, master_element_bytes=8)
    s = rank_static_memory(graph, sharding, optimizer_spec("sgd"))
    root, layer = ROOT_ELEMENTS * F32, LAYER_ELEMENTS * F32
    # FSDP2 pads each first dimension to a multiple of 8: the layers' and the input
    # layer's 16 rows shard evenly (2 each), the head's 4 rows take 1 row per rank
    padded_elements = (2 * 8 + 2) + 3 * (2 * 16 + 2) + (1 * 16 + 1)
    assert s.param_bytes == padded_elements * 8 > math.ceil(2 * params / 8)
    # the head's 4 rows are padded to 8 when all-gathered, its gradients are not
    padded_root = root + (4 * 16 + 4) * F32
    assert s.communication_bytes == padded_root + HEAD_ELEMENTS * F32 + 4 * layer
    assert sharding.shard_bytes(10, Fraction(2)) == 3


def test_ddp_keeps_states_whole_and_adds_buckets(graph: chkpt_opt.CostGraph) -> None:
    params = (ROOT_ELEMENTS + 3 * LAYER_ELEMENTS) * F32
    s = rank_static_memory(graph, Sharding(world_size=64, strategy="ddp"), optimizer_spec("adamw"))
    assert s.param_bytes == params and s.optimizer_state_bytes == 2 * params + 40
    assert s.communication_bytes == params and s.resident_grad_bytes == 0
    assert per_rank_graph(graph, Sharding(world_size=64, strategy="ddp")) is graph
    view = rank_static_memory(
        graph, Sharding(2, strategy="ddp", gradient_as_bucket_view=True), None
    )
    assert view.communication_bytes == 0 and view.resident_grad_bytes == params


def test_per_rank_graph_takes_the_gradients_out_of_time(graph: chkpt_opt.CostGraph) -> None:
    rank = per_rank_graph(graph, Sharding(world_size=2))
    assert all(a["param_grad_bytes"] == 0 for _, a in rank.nodes(data=True))
    assert any(a["param_grad_bytes"] for _, a in graph.nodes(data=True))  # not mutated
    assert unit_param_bytes(rank) == unit_param_bytes(graph)
    assert chkpt_opt.graphs.io.graph_fingerprint(rank) == chkpt_opt.graphs.io.graph_fingerprint(
        graph
    )


def test_the_split_and_the_solve_are_per_rank(graph: chkpt_opt.CostGraph) -> None:
    sharding = Sharding(world_size=4)
    _, static, act = activation_budget(graph, 200_000, sharding=sharding)
    assert act == split_budget(parse_budget(200_000), static) == 200_000 - static.resident_bytes
    result = solve(graph, 200_000, sharding=sharding, solver="greedy")
    profile = simulate_step(graph, result.schedule, sharding=sharding)
    assert result.step_peak_bytes == profile.step_peak_bytes <= 200_000
    one_device = simulate_step(graph, result.schedule)
    assert profile.static.param_bytes < one_device.static.param_bytes


def test_summary_shows_the_per_rank_split() -> None:
    torch.manual_seed(0)
    plan = chkpt_opt.plan(
        _Stack(), (torch.randn(32, 8),), budget="1MB", sharding=Sharding(world_size=8)
    )
    text = plan.summary()
    assert "per rank of 8, fsdp2" in text and "unsharded units" in text, text
    assert plan.sharding == Sharding(world_size=8)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"world_size": 0}, "at least 1"),
        ({"world_size": 2.0}, "not an int"),
        ({"world_size": True}, "not an int"),
        ({"world_size": 2, "strategy": "zero3"}, "unknown"),
        ({"world_size": 2, "master_element_bytes": 3}, "element size"),
    ],
)
def test_bad_values_are_refused_naming_the_fix(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(BudgetError, match=needle):
        Sharding(**kwargs)  # type: ignore[arg-type]


def test_master_bytes_need_the_element_count(graph: chkpt_opt.CostGraph) -> None:
    old = graph.copy()
    del old.graph["param_elements"]
    with pytest.raises(BudgetError, match="param_elements"):
        rank_static_memory(old, Sharding(world_size=2, master_element_bytes=4), None)


def test_sharding_is_read_off_ddp_and_fully_shard() -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("gloo", init_method=f"file://{store}/s", rank=0, world_size=1)
        try:
            assert sharding_of(_Stack()) is None
            ddp = torch.nn.parallel.DistributedDataParallel(_Stack(), gradient_as_bucket_view=True)
            assert sharding_of(ddp) == Sharding(1, "ddp", gradient_as_bucket_view=True)
            model = _Stack()
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
            for layer in model.layers:
                fully_shard(layer, reshard_after_forward=False, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
            assert sharding_of(model) == Sharding(
                1, "fsdp2", reshard_after_forward=False, master_element_bytes=4
            )
            with pytest.raises(chkpt_opt.TraceError, match="before fully_shard"):
                chkpt_opt.plan(model, (torch.randn(4, 8),), budget="1MB")
        finally:
            dist.destroy_process_group()


def test_optimize_plans_one_rank(graph: chkpt_opt.CostGraph) -> None:
    torch.manual_seed(0)
    net = _Stack()
    sharding = Sharding(world_size=4)
    chkpt_opt.optimize(net, budget=200_000, sharding=sharding, profile_times=False, layerwise=False)
    net(torch.randn(32, 8)).sum().backward()
    runner = chkpt_opt.attachment_of(net).runners[0]  # type: ignore[union-attr]
    static = rank_static_memory(graph, sharding, optimizer_spec("adamw"), foreach=False)
    assert runner.resident_bytes == static.resident_bytes
    assert runner.predicted_peak_bytes <= 200_000


def _deep() -> torch.nn.Module:
    torch.manual_seed(0)
    net = _Stack()
    net.layers = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
        for _ in range(3)
    )
    return net


def test_layerwise_plan_checkpoints_whole_layers_in_place() -> None:
    from chkpt_opt.attachment.layerwise import CheckpointedForward
    from chkpt_opt.export.layers import find_layers

    net, x = _deep(), torch.randn(256, 8)
    original = copy.deepcopy(net)
    sharding = Sharding(world_size=2)
    with pytest.raises(BudgetError, match="example_inputs"):
        chkpt_opt.optimize(net, budget=10**6, sharding=sharding)
    rank = per_rank_graph(chkpt_opt.trace(net, (x,)), sharding)
    static = rank_static_memory(rank, sharding, optimizer_spec("adamw"), foreach=False)
    every = chkpt_opt.Schedule.from_spans(rank, list(find_layers(rank).spans))
    low = chkpt_opt.simulate(rank, every).peak_bytes
    high = chkpt_opt.simulate(rank, chkpt_opt.Schedule.from_spans(rank, [])).peak_bytes
    budget = static.resident_bytes + (low + high) // 2
    chkpt_opt.optimize(net, (x,), budget=budget, sharding=sharding, profile_times=False)
    attached = chkpt_opt.attachment_of(net)
    assert isinstance(attached, chkpt_opt.attachment.LayerwiseAttachment)
    assert attached.layer_paths and attached.predicted_peak_bytes <= budget
    assert "layer-wise" in attached.summary()
    wrapped = [net.get_submodule(p) for p in attached.layer_paths]
    assert all(isinstance(m.__dict__["forward"], CheckpointedForward) for m in wrapped)
    net(x).sum().backward()
    original(x).sum().backward()
    for (name, a), b in zip(net.named_parameters(), original.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
    chkpt_opt.detach(net)
    assert all("forward" not in m.__dict__ for m in wrapped)
