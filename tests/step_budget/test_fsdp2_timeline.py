"""FSDP2's buffers placed along one rank's op sequence (chkpt_opt.step_budget.fsdp2_timeline):
padded units, what is alive while a checkpointed layer is recomputed, and the exact prediction
against the budget split's upper bound. Measured against real FSDP2 runs in
tests/attachment/test_fsdp2_plain.py and test_fsdp2.py."""

from __future__ import annotations

import pytest
import torch

import chkpt_opt
from chkpt_opt.export.layers import find_layers
from chkpt_opt.memory_model.op_sequence import Step
from chkpt_opt.step_budget.budget import optimizer_spec
from chkpt_opt.step_budget.fsdp2_timeline import fsdp2_steps, fsdp2_units, rank_timeline
from chkpt_opt.step_budget.sharding import (
    Sharding,
    per_rank_graph,
    predicted_rank_peak_bytes,
    rank_static_memory,
)
from tests.attachment.test_fsdp2_plain import _Stack

WORLD = 2


@pytest.fixture(scope="module")
def rank() -> chkpt_opt.CostGraph:
    # 8 features, width 16, 63 hidden (padded to 64 rows), 3 classes (padded to 4)
    model = _Stack(features=8, width=16, hidden=63, classes=3)
    graph = chkpt_opt.trace(model, (torch.randn(64, 8),))
    return per_rank_graph(graph, Sharding(world_size=WORLD))


def test_units_are_padded_to_the_world_size(rank: chkpt_opt.CostGraph) -> None:
    root, *layers = fsdp2_units(rank, world_size=WORLD)
    # 63 rows pad to 64 (63 columns do not pad); the head's 3 rows to 4; 16 shard evenly
    layer = (64 * 16 + 64) + (16 * 63 + 16)
    head = 4 * 16 + 4
    assert [u.gathered_bytes for u in layers] == [4 * layer] * 3
    assert root.gathered_bytes == 4 * ((16 * 8 + 16) + head)
    assert layers[0].shard_grad_bytes == layers[0].shard_param_bytes == 4 * layer // WORLD
    assert [u.name for u in layers] == ["layers.0", "layers.1", "layers.2"]


def _live_at_recomputation(
    steps: list[Step], layer: int, span: tuple[int, int], rank: chkpt_opt.CostGraph
) -> set[str]:
    """The FSDP2 buffers alive at the first recompute step of ``layer``'s ops."""
    live: set[str] = set()
    for step in steps:
        live.update(inst for inst, _ in step.alloc)
        if step.kind == "recompute" and span[0] <= rank.nodes[step.node]["index"] < span[1]:
            return {inst for inst in live if inst[:3] in ("un:", "ag:", "rs:")}
        live.difference_update(step.free)
    raise AssertionError(f"layer {layer} is never recomputed")


def test_a_recomputed_layer_runs_with_its_parameters_and_the_next_all_gather(
    rank: chkpt_opt.CostGraph,
) -> None:
    spans = list(find_layers(rank).spans)
    every = chkpt_opt.Schedule.from_spans(rank, spans)
    steps = fsdp2_steps(rank, every, fsdp2_units(rank, WORLD))
    # the root's parameters, the layer's own, the layer before all-gathered ahead, and
    # the reduce-scatter input of the layer after, kept until this layer's reduce-scatter
    assert _live_at_recomputation(steps, 2, spans[2], rank) == {"un:root", "un:2", "ag:1"}
    assert _live_at_recomputation(steps, 1, spans[1], rank) == {"un:root", "un:1", "ag:0", "rs:2"}
    assert _live_at_recomputation(steps, 0, spans[0], rank) == {"un:root", "un:0", "rs:1"}
    # without resharding after forward, every layer stays unsharded and nothing is gathered
    kept = fsdp2_steps(rank, every, fsdp2_units(rank, WORLD), reshard=False)
    live = _live_at_recomputation(kept, 0, spans[0], rank)
    assert live == {"un:root", "un:0", "rs:1"}  # layers 1 and 2 resharded after their backward


def test_the_exact_prediction_is_within_the_budget_split(rank: chkpt_opt.CostGraph) -> None:
    sharding = Sharding(world_size=WORLD)
    static = rank_static_memory(rank, sharding, optimizer_spec("adamw"), foreach=False)
    spans = list(find_layers(rank).spans)
    for schedule in (chkpt_opt.Schedule(), chkpt_opt.Schedule.from_spans(rank, spans)):
        bound = static.step_peak_bytes(chkpt_opt.simulate(rank, schedule).peak_bytes)
        exact = predicted_rank_peak_bytes(rank, schedule, sharding, static)
        timeline = rank_timeline(rank, schedule, fsdp2_units(rank, WORLD))
        states = static.param_bytes + static.optimizer_state_bytes
        assert exact == states + static.buffer_bytes + static.input_bytes + timeline.peak_bytes
        assert exact < bound


def test_the_resizing_tracker_sees_storages_resized_in_place() -> None:
    """FSDP2 frees and reallocates unsharded parameters with ``resize_``, which no
    dispatch mode sees: the plain tracker misses it, the resizing one does not."""
    from chkpt_opt.graphs.tracer.storage import ResizingStorageTracker, StorageTracker

    kept = torch.empty(1000)  # made before tracking, like FSDP2's all-gather outputs
    kept.untyped_storage().resize_(0)
    # the plain tracker: 400 + 40 + 4 (``made`` counted after it was freed, ``kept`` never);
    # the resizing one: 4000 + 400 when ``ones`` returns
    for tracker, expected in ((StorageTracker(), 444), (ResizingStorageTracker([kept]), 4400)):
        with tracker:
            kept.untyped_storage().resize_(4000)
            made = torch.ones(100)  # an op after the resize: where the tracker looks
            made.untyped_storage().resize_(0)
            (kept[:10] * 2).sum()
        assert tracker.peak_bytes == expected, type(tracker).__name__
        kept.untyped_storage().resize_(0)


def test_frozen_parameters_are_gathered_not_reduced() -> None:
    model = _Stack(features=8, width=16, hidden=63, classes=3)
    model.head.requires_grad_(False)
    graph = chkpt_opt.trace(model, (torch.randn(64, 8),))
    root, layer, *_ = fsdp2_units(graph, world_size=WORLD)
    head = 4 * (4 * 16 + 4)  # 3 rows padded to 4
    assert root.gathered_bytes - root.reduce_bytes == head
    assert root.shard_grad_bytes == root.reduce_bytes // WORLD
    assert layer.reduce_bytes == layer.gathered_bytes
