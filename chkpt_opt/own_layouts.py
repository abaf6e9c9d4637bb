"""The layouts of the checkpointing a model already has, as chkpt_opt schedules.

What a user runs instead of chkpt_opt, read off a cost graph, so that a plan can be compared
with it in the same cost model:

* ``"layers"``: a region per layer, what ``model.gradient_checkpointing_enable()`` does on a
  Hugging Face model (the layers are :func:`~chkpt_opt.solvers.blocks.repeated.layer_spans`);
* ``"layers, matmuls cached"``: those regions caching their matmuls' outputs
  (:data:`MATMUL_OPS`, where a region may cache them), what selective activation
  checkpointing does (torchtitan's op list, PyTorch's ``MUST_SAVE`` policy per op).

The solvers know nothing of these layouts by name: the cached-op rounding's family holds
them (:mod:`chkpt_opt.solvers.cached.cache_rounding`). At each layout's own peak,
``tests/solvers/cached/test_cache_rounding.py`` checks that the rounding recomputes no more than the
layout, and ``benchmarks/own_layouts.py`` measures what ``auto`` recomputes against it.

Example:
    >>> from chkpt_opt.graphs.synthetic import chain_graph
    >>> own_layouts(chain_graph(6, activation_bytes=1000))  # no named layers
    {}
"""

from __future__ import annotations

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.memory_model.schedule import Schedule, cache_candidates
from chkpt_opt.solvers.blocks.repeated import layer_spans

MATMUL_OPS = frozenset(
    {"linear", "mm", "addmm", "bmm", "matmul", "convolution", "scaled_dot_product_attention"}
)
"""The ops selective activation checkpointing saves, by their base name in a cost graph
(attention is random, so no region caches it:
:func:`~chkpt_opt.memory_model.schedule.cacheable_ops`)."""


def own_layouts(graph: CostGraph) -> dict[str, Schedule]:
    """The layouts of the module docstring by name, in that order; empty where the graph
    has no layers (:func:`~chkpt_opt.solvers.blocks.repeated.layer_spans`)."""
    spans = layer_spans(graph)
    if not spans:
        return {}
    layers = Schedule.from_spans(graph, spans)
    matmuls = frozenset(
        v
        for v in cache_candidates(graph, layers)
        if base_op_name(graph.nodes[v]["op"]) in MATMUL_OPS
    )
    return {"layers": layers, "layers, matmuls cached": Schedule(layers.regions, saved=matmuls)}


def base_op_name(op: str) -> str:
    """An op's base name: ``"aten.linear.default"`` -> ``"linear"``, and for the fx
    fallback's names ``"module:torch.nn.modules.linear.Linear"`` -> ``"linear"``,
    ``"method:matmul"`` -> ``"matmul"``."""
    name = op.split(":", 1)[-1]
    parts = name.split(".")
    if parts[0] == "aten" and len(parts) > 1:
        return parts[1]
    return parts[-1].lower()
