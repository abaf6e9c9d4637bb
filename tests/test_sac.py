"""The eager selective-checkpoint lowering: exact for whole layers, lossy for partial ones."""

from __future__ import annotations

import copy

import pytest
import torch

import chkpt_opt
from chkpt_opt import zoo
from chkpt_opt.export.layers import find_layers
from chkpt_opt.export.sac import (
    dispatched_ops,
    lower_to_sac,
    measure_lowering,
    wrap_modules_in_place,
)
from chkpt_opt.graphs.costgraph import ordered_nodes
from chkpt_opt.measurement.step import measure_step
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate


@pytest.fixture(scope="module")
def traced():
    model, args, _ = zoo.gpt(n_layer=3, d_model=64, n_head=4, seq_len=64, batch=4, vocab=256)
    plan = chkpt_opt.plan(
        model, args, budget=10**15, optimizer=None, solver="keep_all", profile_times=False
    )
    issued = dispatched_ops(plan.traced.captured.module, plan.traced.captured.flat_inputs)
    return model, args, plan.graph, issued


def _grads_after_step(model: torch.nn.Module, args) -> list[torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(0)
    measure_step(model, args)
    return [p.grad.clone() for p in model.parameters()]


def test_ops_are_recorded_after_decomposition(traced) -> None:
    _, _, graph, issued = traced
    linear = next(n for n in ordered_nodes(graph) if graph.nodes[n]["op"] == "aten.linear.default")
    assert "aten.linear.default" not in issued[linear]
    assert any(op in issued[linear] for op in ("aten.addmm.default", "aten.mm.default"))


def test_whole_layer_schedule_is_exact(traced) -> None:
    model, args, graph, issued = traced
    schedule = Schedule.from_spans(graph, list(find_layers(graph).spans))
    lowering = lower_to_sac(graph, schedule, issued)
    assert set(lowering.modules) == {"blocks.0", "blocks.1", "blocks.2"}
    assert all(not saved for saved in lowering.modules.values())  # recompute everything
    assert not lowering.notes
    measured = measure_lowering(model, lowering, args)
    predicted = simulate(graph, schedule).peak_bytes
    assert abs(measured - predicted) <= 0.01 * predicted
    wrapped = wrap_modules_in_place(copy.deepcopy(model), lowering)
    assert all(
        torch.equal(a, b)
        for a, b in zip(_grads_after_step(model, args), _grads_after_step(wrapped, args))
    )


def test_partial_layer_schedule_saves_kept_ops_and_says_it_differs(traced) -> None:
    model, args, graph, issued = traced
    order = ordered_nodes(graph)
    spans = []
    for start, stop in find_layers(graph).spans:
        names = order[start:stop]
        first = next(i for i, n in enumerate(names) if graph.nodes[n]["module_path"].endswith("fc"))
        spans.append((start + first, stop))
    schedule = Schedule.from_spans(graph, spans)
    lowering = lower_to_sac(graph, schedule, issued)
    saved = lowering.modules["blocks.0"]
    assert any(op in saved for op in ("aten.addmm.default", "aten.mm.default"))
    assert "aten.empty_like.default" not in saved  # filled in place by dropout: never cached
    assert any("in part" in note for note in lowering.notes)
    measured = measure_lowering(model, lowering, args)
    keep_all = measure_step(model, args).peak_bytes
    assert measured < keep_all
    wrapped = wrap_modules_in_place(copy.deepcopy(model), lowering)
    assert all(
        torch.equal(a, b)
        for a, b in zip(_grads_after_step(model, args), _grads_after_step(wrapped, args))
    )


def test_ops_written_in_place_later_are_recomputed_not_cached() -> None:
    """A ResNet: batch norm's output is written by ``relu_`` and ``+=``; SAC refuses to hand
    back a cached tensor that was mutated, so the lowering must not cache those outputs."""
    model, args, _ = zoo.resnet(widths=(8, 16), blocks_per_stage=1, image=16, batch=2)
    plan = chkpt_opt.plan(
        model, args, budget=10**15, optimizer=None, solver="keep_all", profile_times=False
    )
    graph = plan.graph
    issued = dispatched_ops(plan.traced.captured.module, plan.traced.captured.flat_inputs)
    order = ordered_nodes(graph)
    spans = []  # the second half of every layer recomputed; the first half's outputs kept
    for start, stop in find_layers(graph).spans:
        spans.append((start + (stop - start) // 2, stop))
    schedule = Schedule.from_spans(graph, spans)
    lowering = lower_to_sac(graph, schedule, issued)
    bn_written = [
        n
        for n in order
        if graph.nodes[n]["op"].startswith("aten.batch_norm")
        and any(graph.nodes[s]["is_inplace"] for s in graph.successors(n))
    ]
    assert bn_written, "the zoo ResNet applies relu_ to batch norm outputs"
    # The kept convolutions are still cached: the lowering is selective, not all-recompute.
    assert any("convolution" in op for saved in lowering.modules.values() for op in saved)
    reference = _grads_after_step(model, args)
    wrapped = wrap_modules_in_place(copy.deepcopy(model), lowering)
    assert all(torch.equal(a, b) for a, b in zip(reference, _grads_after_step(wrapped, args)))
    compiled = torch.compile(wrap_modules_in_place(copy.deepcopy(model), lowering))
    grads = _grads_after_step(compiled, args)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(reference, grads))
