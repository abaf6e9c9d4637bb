"""Codegen replays the default random generators only in regions that may draw from them
(:mod:`chkpt_opt.codegen.randomness`): a region that draws nothing keeps no copy of their
state, which Hugging Face's checkpointing keeps for every layer."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import chkpt_opt
from chkpt_opt.codegen import CheckpointRegion, rewrite_module
from chkpt_opt.graphs.costgraph import ordered_nodes
from chkpt_opt.measurement.step import measure_step, measure_step_allocator
from chkpt_opt.memory_model.schedule import Schedule


class Attention(nn.Module):
    """Two layers of a linear, a tanh, dropout ``p`` and attention at ``attention_p``."""

    def __init__(self, p: float, attention_p: float, width: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.drop = nn.Dropout(p)
        self.attention_p = attention_p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = self.drop(torch.tanh(layer(x)))
            x = x + F.scaled_dot_product_attention(h, h, h, dropout_p=self.attention_p)
        return x.pow(2).mean()


def _planned(model: nn.Module, args: tuple[torch.Tensor, ...]) -> chkpt_opt.Plan:
    return chkpt_opt.plan(
        model, args, budget=10**15, optimizer=None, solver="keep_all", profile_times=False
    )


def _regions(module: nn.Module) -> dict[str, CheckpointRegion]:
    return {n: m for n, m in module.named_modules() if isinstance(m, CheckpointRegion)}


def _spans(order: list[str], spans: list[tuple[int, int]]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(order[a:b]) for a, b in spans)


@pytest.mark.parametrize(
    ("p", "attention_p", "replays"),
    [(0.0, 0.0, False), (0.2, 0.0, True), (0.0, 0.1, True)],
)
def test_a_region_replays_the_generators_only_if_an_op_may_draw(
    p: float, attention_p: float, replays: bool
) -> None:
    model, args = Attention(p, attention_p).train(), (torch.randn(4, 16, 32),)
    made = _planned(model, args)
    order = ordered_nodes(made.graph)
    schedule = Schedule(regions=_spans(order, [(0, len(order) - 2)]))
    optimized = rewrite_module(made.traced.captured.fresh_module(), made.graph, schedule)
    assert [r.replays_rng for r in _regions(optimized).values()] == [replays]


def test_an_outer_region_replays_the_generators_its_inner_region_draws_from() -> None:
    """The outer region's own ops draw nothing, but recomputing it runs its inner region,
    which holds dropout, forward again."""
    torch.manual_seed(0)
    model, args = Attention(0.3, 0.0).train(), (torch.randn(4, 16, 32),)
    reference = copy.deepcopy(model)
    made = _planned(model, args)
    order = ordered_nodes(made.graph)
    drops = [i for i, name in enumerate(order) if "dropout" in name]
    assert len(drops) == 2
    first = drops[0]
    schedule = Schedule(
        regions=_spans(order, [(0, first + 2), (first + 2, drops[1])]),
        nested=_spans(order, [(first, first + 1)]),
    )
    optimized = rewrite_module(made.traced.captured.fresh_module(), made.graph, schedule)
    replays = sorted(r.replays_rng for r in _regions(optimized).values())
    assert replays == [False, True, True]  # the second outer region holds no dropout

    torch.manual_seed(1)
    optimized(*args).backward()
    torch.manual_seed(1)
    reference(*args).backward()
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert mine.grad is not None and torch.equal(mine.grad, theirs.grad)


def test_a_region_that_draws_nothing_holds_no_copy_of_the_generator_state() -> None:
    """The allocator sees every byte of the step: without the replay, a plan's peak is
    the storages its ops make, which is what the cost model predicts."""
    model, args = Attention(0.0, 0.0).train(), (torch.randn(4, 16, 32),)
    made = _planned(model, args)
    order = ordered_nodes(made.graph)
    schedule = Schedule(
        regions=_spans(order, [(0, len(order) // 2), (len(order) // 2, len(order) - 2)])
    )
    optimized = rewrite_module(made.traced.captured.fresh_module(), made.graph, schedule)
    allocated = measure_step_allocator(optimized, args)
    for p in model.parameters():
        p.grad = None
    assert allocated == measure_step(optimized, args).peak_bytes
