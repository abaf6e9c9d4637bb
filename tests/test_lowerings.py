"""Lowerings to trainers' per-layer settings and to the memory viewer: exact and lossy cases."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

import chkpt_opt
from chkpt_opt import zoo
from chkpt_opt.export.layers import find_layers, lower_to_layers
from chkpt_opt.export.snapshot import predicted_snapshot, save_predicted_snapshot
from chkpt_opt.graphs.costgraph import ordered_nodes
from chkpt_opt.memory_model.op_sequence import lower
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate

TARGETS = ["huggingface", "torchtitan", "megatron"]


@pytest.fixture(scope="module")
def graph():
    model, args, _ = zoo.gpt(n_layer=4, d_model=64, n_head=4, seq_len=64, batch=4, vocab=256)
    return chkpt_opt.trace(model, args)


def test_layers_are_found_in_order_and_contiguous(graph) -> None:
    layers = find_layers(graph)
    assert layers.container == "blocks"
    assert len(layers.spans) == 4
    order = ordered_nodes(graph)
    for k, (start, stop) in enumerate(layers.spans):
        assert all(
            graph.nodes[n]["module_path"].startswith(f"blocks.{k}") for n in order[start:stop]
        )


@pytest.mark.parametrize("target", TARGETS)
def test_whole_layer_schedule_lowers_exactly(graph, target: str) -> None:
    layers = find_layers(graph)
    schedule = Schedule.from_spans(graph, list(layers.spans[:2]))  # the first two layers
    lowering = lower_to_layers(graph, schedule, target=target)
    assert lowering.exact, lowering
    assert lowering.layers == (0, 1)
    assert lowering.schedule == schedule
    assert not lowering.notes


def test_targets_speak_their_own_vocabulary(graph) -> None:
    layers = find_layers(graph)
    first_two = Schedule.from_spans(graph, list(layers.spans[:2]))
    every_other = Schedule.from_spans(graph, [layers.spans[0], layers.spans[2]])
    assert lower_to_layers(graph, every_other, target="huggingface").settings == {
        "gradient_checkpointing": True,
        "every_n_layers": 2,
    }
    titan = lower_to_layers(graph, every_other, target="torchtitan").settings[
        "activation_checkpoint"
    ]
    assert titan["per_block"] == {"0": "full", "1": "none", "2": "full", "3": "none"}
    megatron = lower_to_layers(graph, first_two, target="megatron").settings
    assert megatron["flags"] == [
        "--recompute-granularity=full",
        "--recompute-method=block",
        "--recompute-num-layers=2",
    ]


@pytest.mark.parametrize("target", TARGETS)
def test_partial_layer_schedule_loses_and_says_so(graph, target: str) -> None:
    # Recompute only the MLP half of each layer: finer than any per-layer setting.
    order = ordered_nodes(graph)
    spans = []
    for start, stop in find_layers(graph).spans:
        names = order[start:stop]
        first_mlp = next(
            i for i, n in enumerate(names) if graph.nodes[n]["module_path"].endswith("fc")
        )
        spans.append((start + first_mlp, stop))
    schedule = Schedule.from_spans(graph, spans)
    exact = simulate(graph, schedule)
    lowering = lower_to_layers(graph, schedule, target=target, budget_bytes=exact.peak_bytes)
    assert not lowering.exact
    assert lowering.exact_peak_bytes == exact.peak_bytes
    # To fit the same budget the lowering must recompute whole layers: more extra compute.
    assert lowering.lowered_peak_bytes <= exact.peak_bytes
    assert lowering.lowered_overhead > lowering.exact_overhead
    assert any("in part" in note for note in lowering.notes)


def test_megatron_cannot_express_an_arbitrary_set(graph) -> None:
    layers = find_layers(graph)
    schedule = Schedule.from_spans(graph, [layers.spans[1], layers.spans[3]])
    lowering = lower_to_layers(graph, schedule, target="megatron")
    assert lowering.settings["recompute_method"] == "uniform"
    assert lowering.layers == (0, 1, 2, 3)
    assert not lowering.exact and any("arbitrary" in note for note in lowering.notes)


def test_model_without_layers_is_refused() -> None:
    import torch

    class Flat(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(8, 8)
            self.b = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x).relu()).sum()

    graph = chkpt_opt.trace(Flat(), (torch.randn(4, 8),))
    with pytest.raises(ValueError, match="no repeated layers"):
        lower_to_layers(graph, Schedule(), target="huggingface")


def test_snapshot_replays_the_simulated_timeline(graph, tmp_path: Path) -> None:
    layers = find_layers(graph)
    schedule = Schedule.from_spans(graph, list(layers.spans))
    snapshot = predicted_snapshot(graph, schedule)
    live = peak = 0
    sizes = {}
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            sizes[event["addr"]] = event["size"]
            live += event["size"]
        elif event["action"] == "free_completed":
            live -= sizes.pop(event["addr"])
        peak = max(peak, live)
    simulated = simulate(graph, schedule).peak_bytes
    # Sizes are rounded up to 512-byte blocks, as the caching allocator does.
    assert (
        simulated
        <= peak
        <= simulated + 512 * (len(lower(graph, schedule)) + graph.number_of_nodes() * 8)
    )
    path = save_predicted_snapshot(tmp_path / "predicted.pickle", graph, schedule)
    with path.open("rb") as handle:  # the test reads back what the viewer would read
        assert pickle.load(handle) == snapshot
    from torch.cuda import _memory_viz

    assert "<html" in _memory_viz.trace_plot(snapshot).lower()
