"""Codegen of general schedules (nested regions, cached ops) on the hard cases: explicit
generators, several training steps with cached ops, module state written in place.

Each model is trained a few AdamW steps beside an unoptimized copy under a forced general
schedule and compared bit for bit (parameters and buffers), as in ``test_hard_models``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

import chkpt_opt
from chkpt_opt import zoo
from chkpt_opt.codegen import rewrite_module
from chkpt_opt.codegen.runtime import CheckpointRegion
from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes
from chkpt_opt.memory_model.schedule import Schedule, nesting_allowed
from chkpt_opt.solvers import get_solver
from tests.test_hard_models import (
    BatchNormNet,
    CompileNet,
    GeneratorNoise,
    StateUpdates,
    WritesItsInput,
    assert_same_state,
    fresh,
    train,
)

Spans = tuple[tuple[int, int], ...]


def _schedule(graph: CostGraph, regions: Spans, nested: Spans = (), saved=()) -> Schedule:
    order = ordered_nodes(graph)
    return Schedule(
        regions=tuple(tuple(order[a:b]) for a, b in regions),
        nested=tuple(tuple(order[a:b]) for a, b in nested),
        saved=frozenset(order[i] for i in saved),
    )


def _train_beside_reference(
    make: Callable[[], nn.Module],
    args: tuple,
    schedule_of: Callable[[CostGraph], Schedule],
    reseed: Callable[[nn.Module, int], None] | None = None,
) -> None:
    torch.manual_seed(0)
    initial = make().train()
    reference, model = copy.deepcopy(initial), copy.deepcopy(initial)
    plan = chkpt_opt.plan(
        model, fresh(args), budget=10**15, optimizer=None, solver="keep_all", profile_times=False
    )
    schedule = schedule_of(plan.graph)
    optimized = rewrite_module(plan.traced.captured.fresh_module(), plan.graph, schedule)
    train(reference, reference, args, {}, context=contextlib.nullcontext, reseed=reseed)
    train(optimized, model, args, {}, context=contextlib.nullcontext, reseed=reseed)
    assert_same_state(reference, model)


# GeneratorNoise's ops: per layer linear, tanh, rand(generator=...), mul; then sum (17 ops).
@pytest.mark.parametrize(
    ("regions", "nested"),
    [
        (((0, 17),), ((4, 10),)),  # the outer region draws before and after the inner one
        (((4, 8),), ((6, 7),)),  # only the inner region draws from the generator
        (((0, 17),), ((2, 12), (6, 7))),  # three levels
    ],
)
def test_nested_regions_replay_an_explicit_generator(regions: Spans, nested: Spans) -> None:
    """Before the fix: an inner region run again inside its outer region's recomputation
    reset the generator afterwards (so the outer region's later draws repeated the inner
    region's numbers), and an outer region did not replay a generator that only its inner
    regions draw from: wrong gradients, silently."""

    def reseed(model: nn.Module, step: int) -> None:
        model.gen.manual_seed(step)

    _train_beside_reference(
        GeneratorNoise,
        (torch.randn(64, 64),),
        lambda graph: _schedule(graph, regions, nested),
        reseed=reseed,
    )


class DropoutNorm(nn.Module):
    """Linear, dropout and a layer norm in every layer."""

    def __init__(self, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(depth))
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, norm in zip(self.layers, self.norms):
            x = norm(self.drop(torch.tanh(layer(x))))
        return x.pow(2).mean()


def test_a_cached_op_at_the_end_of_a_region_trains_several_steps() -> None:
    """Before the fix, the second step failed ("Tensor cached during selective activation
    checkpoint has been mutated"): checkpoint stopped the recomputation inside the cached
    layer norm, its cache mark was never cleared, and the next forward pass cached every
    op of the region, dropout's mask included, which dropout then fills in place."""
    # Ops per layer: linear, tanh, dropout, layer_norm; then pow, mean.
    _train_beside_reference(
        DropoutNorm,
        (torch.randn(64, 32),),
        lambda graph: _schedule(graph, ((0, 4), (4, 8)), saved=(3, 7)),
    )


# BatchNormNet's ops: per layer conv2d, add_ (num_batches_tracked), batch_norm, relu, then
# the shared norm's add_ and batch_norm; then a functional batch norm, pow, mean (21 ops).
@pytest.mark.parametrize(
    ("regions", "nested"),
    [
        (((3, 12),), ((4, 5),)),  # the shared norm's counter: one update inside, one outside
        (((0, 21),), ((4, 11),)),
        (((0, 21),), ((4, 6), (10, 11))),
        (((0, 21),), ((18, 19),)),  # the functional batch norm on the model's buffers
    ],
)
def test_nested_regions_update_batch_norm_state_once(regions: Spans, nested: Spans) -> None:
    """Before the fix, a batch norm used twice counted its batches one time too many per
    step when its counter's chain of in-place updates began in an inner region: the outer
    region's recomputation ran the inner region's guard (skipped) and then the rest of the
    chain on the real counter. Now an inner region reads written state through its outer
    region, which snapshots it and replays the whole chain into a private copy."""
    _train_beside_reference(
        BatchNormNet, (torch.randn(4, 8, 8, 8),), lambda graph: _schedule(graph, regions, nested)
    )


# WritesItsInput's ops: per layer linear, tanh, add (y); mul_ (y) after the second layer;
# then pow, mean (15 ops).
@pytest.mark.parametrize("nested", [((6, 7),), ((6, 9),), ((5, 7),), ((1, 13), (6, 7))])
def test_nested_regions_around_a_write_of_a_model_input(nested: Spans) -> None:
    """Before the fix: an inner region that doubles the input in place skipped the write
    while its outer region was recomputed, so the outer region's later layers read the
    input undoubled: wrong gradients. The write now goes into the outer region's private
    copy of the input."""
    _train_beside_reference(
        WritesItsInput,
        (torch.randn(64, 64), torch.randn(64, 64)),
        lambda graph: _schedule(graph, ((0, 15),), nested),
    )


class OneHot(nn.Module):
    """A one-hot code (``zeros`` then ``scatter_`` inside) and ``new_zeros`` filled by
    ``index_add``: composite ops whose first kernel's output a later kernel writes."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        code = F.one_hot(h.argmax(-1), h.shape[-1]).to(h.dtype)
        return self.out(h * code + h).pow(2).mean()


def test_cached_composite_ops_whose_kernels_fill_a_factory_output() -> None:
    """Before the fix, caching ``one_hot`` cached its ``zeros`` kernel, which ``scatter_``
    then filled in place: checkpoint refused the changed cache entry on recompute."""

    def schedule(graph: CostGraph) -> Schedule:
        order = ordered_nodes(graph)
        cached = [i for i, n in enumerate(order) if "one_hot" in graph.nodes[n]["op"]]
        assert cached
        return _schedule(graph, ((0, len(order)),), saved=cached)

    _train_beside_reference(OneHot, (torch.randn(32, 16),), schedule)


def _compiled_beside_reference(make: Callable[[], nn.Module], args: tuple, schedule_of) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    initial = make().train()
    reference, model = copy.deepcopy(initial), copy.deepcopy(initial)
    plan = chkpt_opt.plan(
        model, args, budget=10**15, optimizer=None, solver="keep_all", profile_times=False
    )
    schedule = schedule_of(plan.graph)
    optimized = rewrite_module(plan.traced.captured.fresh_module(), plan.graph, schedule)
    compiled = torch.compile(optimized, backend="aot_eager")
    train(reference, reference, args, {}, context=contextlib.nullcontext, reseed=None)
    train(compiled, model, args, {}, context=contextlib.nullcontext, reseed=None)
    assert_same_state(reference, model)
    explained = torch._dynamo.explain(optimized)(*args)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()


def test_torch_compile_of_a_deep_multi_level_schedule() -> None:
    """Before the fix, dynamo traced one checkpoint per level and exceeded Python's
    recursion limit on a 15-level schedule (a prefix nested at every op, as the nested
    solver's prefix shapes make); a compiled region now traces its flat body."""

    def prefixes(graph: CostGraph) -> Schedule:
        n = graph.number_of_nodes()
        return _schedule(graph, ((0, n),), tuple((0, k) for k in range(n - 1, 0, -1)))

    _compiled_beside_reference(CompileNet, (torch.randn(64, 32),), prefixes)


def test_only_outermost_regions_have_flat_bodies_with_each_op_once() -> None:
    """A prefix nested at every op: each op is in every prefix that holds it, but in the
    outermost region's flat body once (before, every region built its own flat body,
    quadratic in the ops: 470,000 node copies and 22 s on a 32-layer decoder)."""
    torch.manual_seed(0)
    model = CompileNet().train()
    args = (torch.randn(64, 32),)
    plan = chkpt_opt.plan(
        model, args, budget=10**15, optimizer=None, solver="keep_all", profile_times=False
    )
    n = plan.graph.number_of_nodes()
    schedule = _schedule(plan.graph, ((0, n),), tuple((0, k) for k in range(n - 1, 0, -1)))
    optimized = rewrite_module(plan.traced.captured.fresh_module(), plan.graph, schedule)
    regions = [m for m in optimized.modules() if isinstance(m, CheckpointRegion)]
    assert len(regions) == n - 1 + 1
    outermost = [m for m in regions if m.flat_body is not m.body]
    assert len(outermost) == 1  # the nested ones inline into it
    ops = [node for node in outermost[0].flat_body.graph.nodes if node.op == "call_function"]
    assert len(ops) <= n


def test_a_flat_body_of_a_thousand_levels_is_built_within_the_stacks_room() -> None:
    """Inlining nested regions into the outermost one's flat body recurses once per level:
    a prefix at every op of a 960-op MLP exceeds Python's default recursion limit without
    the room that deep regions get (it raised RecursionError in 28f9751, where flat bodies
    stopped being built one per region, quadratic in the ops)."""
    model, args, _ = zoo.mlp(width=8, depth=480, batch=4)
    plan = chkpt_opt.plan(
        model, args, budget=10**15, optimizer=None, solver="keep_all", profile_times=False
    )
    order = ordered_nodes(plan.graph)
    nested = tuple(tuple(order[:k]) for k in range(len(order) - 1, 0, -1))
    schedule = Schedule(regions=(tuple(order),), nested=nested)
    optimized = rewrite_module(plan.traced.captured.fresh_module(), plan.graph, schedule)
    (outermost,) = [
        m for m in optimized.modules() if isinstance(m, CheckpointRegion) and m.source is None
    ]
    assert outermost.nesting_levels >= 900
    assert sum(n.op == "call_function" for n in outermost.flat_body.graph.nodes) <= len(order)


def test_torch_compile_of_nested_regions_with_state_updates() -> None:
    """Inner regions with batch-norm updates and their guards, inlined for compile: the
    running statistics and counters end as the reference's."""
    _compiled_beside_reference(
        BatchNormNet,
        (torch.randn(4, 8, 8, 8),),
        lambda graph: _schedule(graph, ((0, 21),), ((2, 19), (4, 11), (5, 6), (6, 7))),
    )


def test_torch_compile_of_cached_ops_at_every_level() -> None:
    """Cached ops in an outer region and in two levels of regions nested in it, inlined for
    compile: each runs through its annotated call (the inner flat bodies' callees carried
    into the outer one), and the model trains as the reference does."""
    _compiled_beside_reference(
        CompileNet,
        (torch.randn(64, 32),),
        lambda graph: _schedule(graph, ((8, 16),), ((9, 14), (11, 13)), saved=(8, 9, 12)),
    )


def test_a_cached_op_beside_a_buffer_update_under_no_grad() -> None:
    """Before the fix, the recomputation failed ("aten.clone.default encountered during
    backward but not found in storage"): a region that updates a buffer inside
    ``torch.no_grad()`` (a higher-order op, snapshotted) makes a private copy of it when
    recomputed, which the selective policy of a region caching an op had not counted in
    the forward pass."""
    state = [
        "sigmoid",
        "mul",
        "linear_1",
        "tanh_1",
        "mul_",
        "detach",
        "mean",
        "add_",
        "add__1",
        "sigmoid_1",
        "mul_1",
        "add__2",
        "getitem_2",
        "add",
        "linear_2",
    ]
    schedule = Schedule(
        regions=(tuple(state),),
        nested=(("mul_", "detach"), ("mul_",), ("sigmoid_1", "mul_1", "add__2", "getitem_2")),
        saved=frozenset({"sigmoid_1"}),
    )
    _train_beside_reference(StateUpdates, (torch.randn(64, 64),), lambda graph: schedule)


@pytest.mark.parametrize(("make", "may_nest"), [(WritesItsInput, False), (GeneratorNoise, True)])
def test_the_nested_search_does_not_nest_over_state_written_in_place(make, may_nest) -> None:
    """The snapshots an outer region takes of state written in place are not in the op
    sequence (see schedule.nesting_allowed): the nested search keeps to one level of
    regions on such graphs, and nests elsewhere."""
    args = (torch.randn(64, 64), torch.randn(64, 64))[: 2 if make is WritesItsInput else 1]
    plan = chkpt_opt.plan(
        make(), args, budget=10**15, optimizer=None, solver="keep_all", profile_times=False
    )
    assert nesting_allowed(plan.graph) is may_nest
    result = get_solver("nested")(plan.graph, 0, time_limit_s=20)
    assert bool(result.schedule.nested) is may_nest
    assert result.stats["nesting_allowed"] is may_nest
