"""The layer-level conv nets: well-formed cost graphs, the layers and saved tensors of each
network, FLOPs from shapes, and the corpus files the one command regenerates."""

from __future__ import annotations

from pathlib import Path

import pytest

from chkpt_opt.corpus import generate_corpus
from chkpt_opt.graphs.costgraph import check_graph, ordered_nodes
from chkpt_opt.memory_model.op_sequence import lower
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.zoo.layer_level import (
    FLOPS_PER_S,
    LAYER_GRAPHS,
    fcn8_layers,
    segnet_layers,
    unet_layers,
    vgg16_layers,
    vgg19_layers,
)

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20


@pytest.mark.parametrize("family", sorted(LAYER_GRAPHS))
def test_every_layer_graph_passes_the_costgraph_checks_and_ends_in_the_loss(family: str) -> None:
    graph = LAYER_GRAPHS[family](batch=2, image=64)
    check_graph(graph)
    assert graph.graph["outputs"] == ["loss"]
    assert ordered_nodes(graph)[-1] == "loss"
    assert all(graph.has_node(u) for u in graph.predecessors("loss"))
    for node, attrs in graph.nodes(data=True):
        assert attrs["fwd_time_s"] == pytest.approx(attrs["fwd_flops"] / FLOPS_PER_S), node
        assert attrs["fwd_flops"] > 0 and attrs["bwd_flops"] > 0, node


def test_the_corpus_files_are_what_the_corpus_command_writes(tmp_path: Path) -> None:
    names = [f"{family}_layers" for family in LAYER_GRAPHS]
    written = generate_corpus(tmp_path, names=names)
    for path in written:
        assert path.read_bytes() == (ROOT / "graphs" / path.name).read_bytes(), path.name


def test_vgg_layer_counts_and_what_conv_and_pool_save() -> None:
    vgg16, vgg19 = vgg16_layers(batch=8), vgg19_layers(batch=8)
    assert vgg16.number_of_nodes() == 13 + 5 + 3 + 1
    assert vgg19.number_of_nodes() == 16 + 5 + 3 + 1
    ops = [vgg19.nodes[n]["op"] for n in ordered_nodes(vgg19)]
    assert ops.count("layer.conv_relu") == 16 and ops.count("layer.max_pool") == 5
    conv = vgg16.nodes["conv1_2"]
    out = 8 * 64 * 224 * 224 * 4
    # conv + bias + ReLU saves its input (conv1_1's output) and its own output
    assert conv["saved"] == {"conv1_1": out, "conv1_2": out}
    assert conv["fwd_flops"] == 2 * 8 * 64 * 224 * 224 * 64 * 9 + 2 * 8 * 64 * 224 * 224
    # the first conv reads the resident input: it saves only its output
    assert vgg16.nodes["conv1_1"]["saved"] == {"conv1_1": out}
    # max-pool saves its input and its int64 indices, a buffer it owns
    assert vgg16.nodes["pool1"]["saved"] == {"conv1_2": out, "pool1:buf0": out // 4 * 2}
    assert vgg16.nodes["pool1"]["output_bytes"] == out // 4


def test_segnet_keeps_each_pools_indices_until_its_unpool() -> None:
    graph = segnet_layers(batch=8)
    assert graph.number_of_nodes() == 13 + 5 + 5 + 13 + 1
    for s in range(1, 6):
        unpool = graph.nodes[f"unpool{s}"]
        assert unpool["saved"] == {
            f"pool{s}:buf0": graph.nodes[f"pool{s}"]["saved"][f"pool{s}:buf0"]
        }
        if s < 5:  # it reads no pooled output of its own level
            assert not graph.has_edge(f"pool{s}", f"unpool{s}")
    # under keep-all, pool1's indices are allocated by pool1's forward and freed only by
    # pool1's backward, after unpool1's, which reads them
    steps = lower(graph, Schedule())
    made = [
        p for p, step in enumerate(steps) if ("f:pool1:buf0", 8 * 64 * 112 * 112 * 8) in step.alloc
    ]
    freed = [p for p, step in enumerate(steps) if "f:pool1:buf0" in step.free]
    assert [steps[p].node for p in made + freed] == ["pool1", "pool1"]
    assert steps[freed[0]].kind == "bwd"
    assert freed[0] > next(
        p for p, st in enumerate(steps) if st.kind == "bwd" and st.node == "unpool1"
    )


def test_fcn8_adds_the_pool3_and_pool4_scores_through_long_skips() -> None:
    graph = fcn8_layers()
    assert graph.number_of_nodes() == 29
    assert graph.has_edge("pool4", "score_pool4") and graph.has_edge("pool3", "score_pool3")
    assert sorted(graph.predecessors("fuse_pool4")) == ["score_pool4", "upscore2"]
    assert sorted(graph.predecessors("fuse_pool3")) == ["score_pool3", "upscore_pool4"]
    assert graph.nodes["fuse_pool3"]["saved"] == {}  # an addition saves nothing


def test_unet_concatenates_each_encoder_level_into_the_decoder() -> None:
    graph = unet_layers(batch=1, image=64, base=8, depth=3)
    for level in (1, 2, 3):
        assert sorted(graph.predecessors(f"cat{level}")) == [f"enc{level}_2", f"up{level}"]
        cat = graph.nodes[f"cat{level}"]
        assert cat["saved"] == {} and cat["output_bytes"] == (
            graph.nodes[f"enc{level}_2"]["output_bytes"] + graph.nodes[f"up{level}"]["output_bytes"]
        )


def test_a_bad_image_size_names_the_value_and_the_fix() -> None:
    with pytest.raises(ValueError, match="image 100 must be"):
        vgg16_layers(image=100)


def test_keep_all_peaks_of_the_corpus_sizes() -> None:
    peaks = {f: simulate(b(), Schedule()).peak_bytes / MIB for f, b in LAYER_GRAPHS.items()}
    assert peaks == pytest.approx(
        {"vgg16": 2737.2, "vgg19": 2893.2, "fcn8": 2759.9, "segnet": 4832.8, "unet": 9040.6},
        abs=0.1,
    )
