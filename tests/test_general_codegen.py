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
from torch import nn

import chkpt_opt
from chkpt_opt.codegen import apply_schedule
from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes
from chkpt_opt.schedule import Schedule
from tests.test_hard_models import GeneratorNoise, assert_same_state, train

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
    plan = chkpt_opt.plan(model, args, budget=10**15, optimizer=None, solver="keep_all")
    schedule = schedule_of(plan.graph)
    optimized = apply_schedule(plan.traced.captured.fresh_module(), plan.graph, schedule)
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
