"""The benchmark corpus: cost graphs of standard networks, each family at two sizes or more.

``chkpt-opt corpus`` (or :func:`generate_corpus`) traces every entry of :data:`CORPUS` from
the models' code in :mod:`chkpt_opt.zoo` and writes ``graphs/<name>.json``. Tracing runs on
fake tensors with deterministic op names and a roofline time model, so the files are the
same bytes on every run of the same chkpt_opt and torch versions. The layer-level conv nets
(family ``layers``: one node per layer, :mod:`chkpt_opt.zoo.layer_level`) are built from
their layer shapes, without torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chkpt_opt import zoo
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.zoo import layer_level


@dataclass(frozen=True)
class CorpusEntry:
    """One network of the corpus.

    Attributes:
        name: file stem, ``<family>_<size>``.
        family: ``chain``, ``resnet``, ``unet``, ``mobilenet``, ``encoder``, ``decoder``, ``vit``,
            ``layers``.
        builder: the zoo function: a model to trace, or (family ``layers``) the cost graph.
        settings: its keyword arguments.
    """

    name: str
    family: str
    builder: Callable[..., zoo.Built] | Callable[..., CostGraph]
    settings: dict[str, Any] = field(default_factory=dict)


CORPUS: tuple[CorpusEntry, ...] = (
    CorpusEntry("mlp_small", "chain", zoo.mlp, {"width": 256, "depth": 8, "batch": 64}),
    CorpusEntry("mlp_large", "chain", zoo.mlp, {"width": 512, "depth": 32, "batch": 256}),
    CorpusEntry("vgg_small", "chain", zoo.vgg, {"widths": (16, 32), "image": 32, "batch": 8}),
    CorpusEntry(
        "vgg_large",
        "chain",
        zoo.vgg,
        {"widths": (32, 64, 128, 256), "convs_per_stage": 3, "image": 64, "batch": 16},
    ),
    CorpusEntry(
        "resnet_small",
        "resnet",
        zoo.resnet,
        {"widths": (16, 32), "blocks_per_stage": 2, "image": 32, "batch": 8},
    ),
    CorpusEntry(
        "resnet_large",
        "resnet",
        zoo.resnet,
        {"widths": (64, 128, 256, 512), "blocks_per_stage": 2, "image": 64, "batch": 16},
    ),
    CorpusEntry("unet_small", "unet", zoo.unet, {"base": 8, "depth": 2, "image": 32, "batch": 2}),
    CorpusEntry("unet_large", "unet", zoo.unet, {"base": 16, "depth": 4, "image": 128, "batch": 4}),
    CorpusEntry(
        "mobilenet_small", "mobilenet", zoo.mobilenet, {"widths": (16, 24), "image": 32, "batch": 8}
    ),
    CorpusEntry(
        "mobilenet_large",
        "mobilenet",
        zoo.mobilenet,
        {
            "widths": (16, 24, 32, 64, 96),
            "blocks_per_stage": 3,
            "expand": 6,
            "image": 64,
            "batch": 16,
        },
    ),
    CorpusEntry(
        "encoder_small",
        "encoder",
        zoo.encoder,
        {"n_layer": 2, "d_model": 64, "seq_len": 64, "batch": 4},
    ),
    CorpusEntry(
        "encoder_large",
        "encoder",
        zoo.encoder,
        {"n_layer": 12, "d_model": 256, "seq_len": 256, "batch": 8},
    ),
    CorpusEntry(
        "gpt_small",
        "decoder",
        zoo.gpt,
        {"n_layer": 4, "d_model": 128, "seq_len": 128, "batch": 4, "vocab": 1024},
    ),
    CorpusEntry("gpt_reference", "decoder", zoo.gpt, {}),
    CorpusEntry(
        "gpt_large",
        "decoder",
        zoo.gpt,
        {"n_layer": 24, "d_model": 512, "n_head": 8, "seq_len": 512, "batch": 8, "vocab": 8192},
    ),
    CorpusEntry(
        "vit_small", "vit", zoo.vit, {"n_layer": 2, "d_model": 64, "image": 32, "batch": 8}
    ),
    CorpusEntry(
        "vit_large",
        "vit",
        zoo.vit,
        {"n_layer": 12, "d_model": 384, "n_head": 6, "image": 64, "patch": 8, "batch": 16},
    ),
    *(
        CorpusEntry(f"{name}_layers", "layers", builder)
        for name, builder in layer_level.LAYER_GRAPHS.items()
    ),
)


def corpus_entries(names: list[str] | None = None) -> list[CorpusEntry]:
    """Entries by name (all when ``names`` is None); unknown names raise ValueError."""
    if names is None:
        return list(CORPUS)
    known = {e.name: e for e in CORPUS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown corpus entries {unknown}; known: {sorted(known)}")
    return [known[n] for n in names]


def generate_corpus(
    out_dir: str | Path = "graphs",
    *,
    names: list[str] | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> list[Path]:
    """Traces the corpus models and writes their cost graphs; returns the files written.

    The models are built with random weights; their activations are never allocated (the
    tracer runs on fake tensors).
    """
    from chkpt_opt.graphs.io import save_graph
    from chkpt_opt.graphs.tracer import trace_model

    out = Path(out_dir)
    written = []
    entries = corpus_entries(names)
    for k, entry in enumerate(entries):
        if progress is not None:
            progress(k, len(entries), entry.name)
        if entry.family == "layers":
            graph = entry.builder(**entry.settings)
            graph.graph["name"] = entry.name
        else:
            model, args, kwargs = entry.builder(**entry.settings)
            graph = trace_model(model, args, kwargs, name=entry.name).graph
        graph.graph["family"] = entry.family
        path = out / f"{entry.name}.json"
        save_graph(graph, path)
        written.append(path)
    if progress is not None:
        progress(len(entries), len(entries), "")
    return written
