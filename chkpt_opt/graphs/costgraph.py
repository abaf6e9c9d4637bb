"""The CostGraph: a networkx DiGraph of forward ops with the costs a schedule depends on.

One node per op, keyed by its fx node name; ``index`` gives the execution order. An edge
``u -> v`` means that ``v`` reads the value ``u`` produced.

Memory is described at the level of *storages* (what an allocator really holds), named by
string ids: a node's outputs own the storages in ``outputs``; a view or an in-place op owns
none and lists the storages it refers to in ``aliases``; what the op's backward keeps is in
``saved`` (storages of earlier outputs, of this node's outputs, or buffers the op allocates
for itself, ids ``"<node>:buf<k>"``). A storage kept by two ops therefore counts once.
Parameters, buffers and inputs are not storages of the graph: they live for the whole step
and are summed in graph attributes.

Node attributes (units in the names):

=====================  ======================================================================
``index``              execution order, 0..n-1
``op``                 op name, e.g. ``"aten.linear.default"``
``module_path``        dotted path of the module the op came from (``""`` at the top)
``outputs``            {storage id: bytes} allocated for the op's outputs
``aliases``            storage ids the output refers to without owning (views, in-place ops)
``saved``              {storage id: bytes} activation storages the backward keeps
``n_saved``            number of tensors autograd saves (parameters and inputs included)
``output_bytes``       sum of ``outputs``
``saved_bytes``        sum of ``saved``
``fwd_workspace_bytes``  transient bytes while the forward op runs, beyond what it leaves
``bwd_workspace_bytes``  transient bytes while its backward runs, beyond the grads it leaves
``grad_bytes``         bytes of the gradient of the op's output (0 without one)
``requires_grad``      the output requires grad
``has_backward``       autograd runs this op's backward in the training step
``bwd_grad_alias``     the backward passes the output gradient on as a view (no new bytes)
``param_grad_bytes``   parameter gradients first created by this op's backward
``fwd_flops``          floating-point operations of the forward op
``bwd_flops``          floating-point operations of its backward
``fwd_time_s``         estimated (or measured) forward time, seconds
``bwd_time_s``         estimated (or measured) backward time, seconds
``is_view``            the output owns no memory
``is_inplace``         the op writes into one of its inputs
``is_random``          the op draws random numbers (dropout, ...)
``is_stateful``        the op updates module state (batch-norm statistics, buffer updates)
``cut_after_ok``       a recompute region may begin or end right after this op (False inside a
                       tuple and its getitems, between an output and an in-place op on it,
                       and inside no-grad spans)
=====================  ======================================================================

Edge attribute: ``uses``, how many arguments of ``v`` read ``u``'s value (``x * x`` reads
``x`` twice, and autograd then sums two gradients for ``x``); 1 when absent.

Graph attributes: ``format_version``, ``name``, ``param_bytes``, ``trainable_param_bytes``,
``buffer_bytes``, ``input_bytes``, ``largest_param_bytes``, ``n_trainable_tensors`` (for
optimizer state), ``device_type`` (where the model was traced: ``cpu``, ``cuda``, ``meta``),
``outputs`` (names of the nodes whose values the step returns), ``tracer``,
``torch_version``, ``cost_model``; optionally ``param_elements`` (for per-rank budgets in
another dtype), ``region_overhead_s``, ``cached_region_overhead_s`` and
``cached_op_overhead_s`` (what regions cost beyond their ops:
:mod:`chkpt_opt.memory_model.region_replay`), ``workspace_model``
(``measured-cuda`` where the kernel workspace the allocator holds beyond tensors was measured
on the device and added to the workspace attributes) and ``grad_outputs`` (the outputs whose
gradient the step seeds, where not all: a model's loss beside its logits).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

import networkx as nx

from chkpt_opt.errors import GraphFormatError, short
from chkpt_opt.graphs.frozen import graph_fact

CostGraph = nx.DiGraph
"""Type alias: a CostGraph is a plain ``networkx.DiGraph`` with the attributes above."""

FORMAT_VERSION = 1

MAX_BYTES = 2**60
"""Largest byte count accepted anywhere (an exabyte): larger values mean a corrupt file."""

MAX_FLOPS = 10**24

_INT_ATTRS = (
    "index",
    "n_saved",
    "output_bytes",
    "saved_bytes",
    "fwd_workspace_bytes",
    "bwd_workspace_bytes",
    "grad_bytes",
    "param_grad_bytes",
    "fwd_flops",
    "bwd_flops",
)
_FLOAT_ATTRS = ("fwd_time_s", "bwd_time_s")
_BOOL_ATTRS = (
    "requires_grad",
    "has_backward",
    "bwd_grad_alias",
    "is_view",
    "is_inplace",
    "is_random",
    "is_stateful",
    "cut_after_ok",
)
_STR_ATTRS = ("op", "module_path")
_GRAPH_SECONDS_ATTRS = ("region_overhead_s", "cached_region_overhead_s", "cached_op_overhead_s")
"""Optional graph attributes in seconds, each in [0, 1) (0 when absent)."""

_GRAPH_INT_ATTRS = (
    "param_bytes",
    "trainable_param_bytes",
    "buffer_bytes",
    "input_bytes",
    "largest_param_bytes",
    "n_trainable_tensors",
)

NODE_ATTRS: tuple[str, ...] = (
    *_INT_ATTRS,
    *_FLOAT_ATTRS,
    *_BOOL_ATTRS,
    *_STR_ATTRS,
    "outputs",
    "aliases",
    "saved",
)


def node_attrs(
    *,
    index: int,
    op: str,
    outputs: Mapping[str, int] | None = None,
    aliases: Iterable[str] = (),
    saved: Mapping[str, int] | None = None,
    n_saved: int | None = None,
    module_path: str = "",
    fwd_workspace_bytes: int = 0,
    bwd_workspace_bytes: int = 0,
    grad_bytes: int = 0,
    requires_grad: bool = True,
    has_backward: bool | None = None,
    bwd_grad_alias: bool = False,
    param_grad_bytes: int = 0,
    fwd_flops: int = 0,
    bwd_flops: int = 0,
    fwd_time_s: float = 0.0,
    bwd_time_s: float = 0.0,
    is_inplace: bool = False,
    is_random: bool = False,
    is_stateful: bool = False,
    cut_after_ok: bool = True,
) -> dict[str, Any]:
    """Builds a complete node attribute dict, deriving the totals and flags it can.

    Example:
        >>> a = node_attrs(index=0, op="aten.relu.default", outputs={"relu": 4096},
        ...                saved={"relu": 4096}, grad_bytes=4096)
        >>> a["output_bytes"], a["saved_bytes"], a["is_view"]
        (4096, 4096, False)
    """
    outputs = dict(outputs or {})
    saved = dict(saved or {})
    aliases = list(aliases)
    return {
        "index": index,
        "op": op,
        "module_path": module_path,
        "outputs": outputs,
        "aliases": aliases,
        "saved": saved,
        "n_saved": len(saved) if n_saved is None else n_saved,
        "output_bytes": sum(outputs.values()),
        "saved_bytes": sum(saved.values()),
        "fwd_workspace_bytes": fwd_workspace_bytes,
        "bwd_workspace_bytes": bwd_workspace_bytes,
        "grad_bytes": grad_bytes,
        "requires_grad": requires_grad,
        "has_backward": requires_grad if has_backward is None else has_backward,
        "bwd_grad_alias": bwd_grad_alias,
        "param_grad_bytes": param_grad_bytes,
        "fwd_flops": fwd_flops,
        "bwd_flops": bwd_flops,
        "fwd_time_s": float(fwd_time_s),
        "bwd_time_s": float(bwd_time_s),
        "is_view": not outputs,
        "is_inplace": is_inplace,
        "is_random": is_random,
        "is_stateful": is_stateful,
        "cut_after_ok": cut_after_ok,
    }


def new_graph(
    name: str,
    *,
    param_bytes: int = 0,
    trainable_param_bytes: int = 0,
    buffer_bytes: int = 0,
    input_bytes: int = 0,
    largest_param_bytes: int = 0,
    n_trainable_tensors: int = 0,
    device_type: str = "cpu",
    tracer: str = "synthetic",
    torch_version: str = "",
    cost_model: str = "",
) -> CostGraph:
    """Returns an empty CostGraph with its graph attributes set."""
    graph = nx.DiGraph()
    graph.graph.update(
        format_version=FORMAT_VERSION,
        name=name,
        param_bytes=param_bytes,
        trainable_param_bytes=trainable_param_bytes,
        buffer_bytes=buffer_bytes,
        input_bytes=input_bytes,
        largest_param_bytes=largest_param_bytes,
        n_trainable_tensors=n_trainable_tensors,
        device_type=device_type,
        outputs=[],
        tracer=tracer,
        torch_version=torch_version,
        cost_model=cost_model,
    )
    return graph


@graph_fact
def ordered_nodes(graph: CostGraph) -> list[str]:
    """Node names in execution order."""
    return sorted(graph.nodes, key=lambda n: graph.nodes[n]["index"])


@graph_fact
def attributes_by_node(graph: CostGraph) -> dict[str, dict[str, Any]]:
    """Each node's attribute dict by name, as a plain dict: for code that reads them many
    times (a simulation reads them thousands of times, faster than through the graph)."""
    return dict(graph.nodes(data=True))


def storage_refs(graph: CostGraph, node: str) -> list[str]:
    """Storage ids that the value of ``node`` refers to (owned outputs, then aliases)."""
    attrs = graph.nodes[node]
    return [*attrs["outputs"], *attrs["aliases"]]


@graph_fact
def storage_owners(graph: CostGraph) -> dict[str, str]:
    """Maps each storage id to the node whose forward allocates it."""
    owners: dict[str, str] = {}
    for node in ordered_nodes(graph):
        attrs = graph.nodes[node]
        for sid in attrs["outputs"]:
            owners[sid] = node
        for sid in attrs["saved"]:
            owners.setdefault(sid, node)
    return owners


def owned_storages(graph: CostGraph, node: str, owners: dict[str, str]) -> dict[str, int]:
    """The storages that the forward of ``node`` allocates, with their bytes: its outputs,
    and the saved storages it owns (``owners`` as :func:`storage_owners` returns it)."""
    attrs = graph.nodes[node]
    made = dict(attrs["outputs"])
    for sid, nbytes in attrs["saved"].items():
        if owners[sid] == node:
            made.setdefault(sid, nbytes)
    return made


def storages_read(graph: CostGraph, node: str, owners: dict[str, str]) -> list[str]:
    """The storages ``node`` reads: those of its inputs (in execution order), then the
    saved storages of other ops it reads without an edge; each once."""
    preds = sorted(graph.predecessors(node), key=lambda u: graph.nodes[u]["index"])
    found = [sid for u in preds for sid in storage_refs(graph, u)]
    found += [sid for sid in graph.nodes[node]["saved"] if owners[sid] != node]
    return list(dict.fromkeys(found))


def edge_uses(graph: CostGraph, u: str, v: str) -> int:
    """How many arguments of ``v`` read the value of ``u`` (1 unless given)."""
    return int(graph.edges[u, v].get("uses", 1))


def grad_outputs(graph: CostGraph) -> list[str]:
    """The outputs whose gradient the step seeds (those with a backward among them):
    ``grad_outputs`` where the tracer wrote it (a loss returned beside logits that receive
    no gradient), every output otherwise."""
    return list(graph.graph.get("grad_outputs", graph.graph["outputs"]))


def region_overhead_s(graph: CostGraph) -> float:
    """Seconds one recompute region adds to a step beyond recomputing its ops (the
    checkpoint call, its saved-tensor hooks and the replay's setup): the graph attribute
    ``region_overhead_s``, measured by ``trace(..., profile_times=True)``; 0 when absent."""
    return float(graph.graph.get("region_overhead_s", 0.0))


def total_compute_s(graph: CostGraph) -> float:
    """Estimated time of one forward and backward pass without recomputation."""
    return sum(
        a["fwd_time_s"] + (a["bwd_time_s"] if a["has_backward"] else 0.0)
        for _, a in graph.nodes(data=True)
    )


def _fail(message: str) -> GraphFormatError:
    return GraphFormatError(message)


def check_graph(graph: CostGraph) -> None:
    """Checks that ``graph`` is a well-formed CostGraph.

    Raises:
        GraphFormatError: naming the node and attribute that is wrong, and what was expected.
    """
    if not isinstance(graph, nx.DiGraph):
        raise _fail(f"a CostGraph must be a networkx.DiGraph, got {type(graph).__name__}.")
    version = graph.graph.get("format_version")
    if version != FORMAT_VERSION:
        raise _fail(
            f"cost graph format_version {short(version)} is not supported (this chkpt_opt reads "
            f"version {FORMAT_VERSION}); regenerate it with `chkpt-opt trace`."
        )
    for key in _GRAPH_INT_ATTRS:
        _check_int(graph.graph.get(key), f"graph attribute {short(key)}", MAX_BYTES)
    for key in ("name", "device_type", "tracer", "torch_version", "cost_model"):
        if not isinstance(graph.graph.get(key), str):
            raise _fail(f"graph attribute {short(key)} must be a string.")
    for key in _GRAPH_SECONDS_ATTRS:
        seconds = graph.graph.get(key, 0.0)
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, (int, float))
            or not 0.0 <= seconds < 1.0
        ):
            raise _fail(
                f"graph attribute {short(key)} must be seconds in [0, 1), got "
                f"{short(seconds)}; remove it (0) or measure it with "
                "trace(..., profile_times=True)."
            )
    if not isinstance(graph.graph.get("outputs"), list):
        raise _fail("graph attribute 'outputs' must be a list of node names.")
    for out in graph.graph["outputs"]:
        if out not in graph:
            raise _fail(f"graph output {short(out)} is not a node of the graph.")
    chosen = graph.graph.get("grad_outputs", [])
    if not isinstance(chosen, list) or not set(chosen) <= set(graph.graph["outputs"]):
        raise _fail(
            f"graph attribute 'grad_outputs' {short(chosen)} is not a list of graph outputs; "
            "name nodes of 'outputs' there, or remove it (every output is differentiated)."
        )
    if not nx.is_directed_acyclic_graph(graph):
        cycle = nx.find_cycle(graph)
        raise _fail(f"a CostGraph must be acyclic; found the cycle {cycle}.")

    indices = []
    for node, attrs in graph.nodes(data=True):
        if not isinstance(node, str):
            raise _fail(f"node keys must be strings, got {short(node)}.")
        missing = [k for k in NODE_ATTRS if k not in attrs]
        if missing:
            raise _fail(f"node {short(node)} lacks attributes {missing}.")
        for key in _INT_ATTRS:
            bound = MAX_FLOPS if key.endswith("flops") else MAX_BYTES
            _check_int(attrs[key], f"node {short(node)} attribute {short(key)}", bound)
        for key in _FLOAT_ATTRS:
            value = attrs[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise _fail(
                    f"node {short(node)} attribute {short(key)} must be a number, "
                    f"got {short(value)}."
                )
            # Compared, not converted: an int beyond float's range must fail here too.
            if not 0 <= value <= sys.float_info.max:
                raise _fail(f"node {short(node)} attribute {short(key)} must be finite and >= 0.")
        for key in _BOOL_ATTRS:
            if not isinstance(attrs[key], bool):
                raise _fail(f"node {short(node)} attribute {short(key)} must be a bool.")
        for key in _STR_ATTRS:
            if not isinstance(attrs[key], str):
                raise _fail(f"node {short(node)} attribute {short(key)} must be a string.")
        for key in ("outputs", "saved"):
            table = attrs[key]
            if not isinstance(table, dict):
                raise _fail(
                    f"node {short(node)} attribute {short(key)} must map storage ids to bytes."
                )
            for sid, nbytes in table.items():
                if not isinstance(sid, str):
                    raise _fail(
                        f"node {short(node)} {key} has a non-string storage id {short(sid)}."
                    )
                _check_int(nbytes, f"node {short(node)} {key}[{short(sid)}]", MAX_BYTES)
        if not isinstance(attrs["aliases"], list) or not all(
            isinstance(s, str) for s in attrs["aliases"]
        ):
            raise _fail(f"node {short(node)} attribute 'aliases' must be a list of storage ids.")
        if attrs["output_bytes"] != sum(attrs["outputs"].values()):
            raise _fail(f"node {short(node)}: output_bytes differs from the sum of its outputs.")
        if attrs["saved_bytes"] != sum(attrs["saved"].values()):
            raise _fail(
                f"node {short(node)}: saved_bytes differs from the sum of its saved storages."
            )
        indices.append(attrs["index"])
    if sorted(indices) != list(range(graph.number_of_nodes())):
        raise _fail("node indices must be 0..n-1, each used once.")
    for u, v, attrs in graph.edges(data=True):
        if graph.nodes[u]["index"] >= graph.nodes[v]["index"]:
            raise _fail(f"edge {short(u)} -> {short(v)} goes against the execution order.")
        uses = attrs.get("uses", 1)
        if isinstance(uses, bool) or not isinstance(uses, int) or not 1 <= uses <= 1 << 20:
            raise _fail(
                f"edge {short(u)} -> {short(v)} attribute 'uses' must be an int >= 1, "
                f"got {short(uses)}."
            )

    defined: set[str] = set()
    for node in ordered_nodes(graph):
        attrs = graph.nodes[node]
        for sid in attrs["aliases"]:
            if sid not in defined:
                raise _fail(
                    f"node {short(node)} aliases storage {short(sid)}, which no earlier node owns."
                )
        for sid in attrs["outputs"]:
            if sid in defined:
                raise _fail(f"storage {short(sid)} is owned by two nodes (again by {short(node)}).")
            defined.add(sid)
        for sid in attrs["saved"]:
            if sid not in defined:
                if not sid.startswith(f"{node}:"):
                    raise _fail(
                        f"node {short(node)} saves storage {short(sid)}, which is neither an "
                        f"earlier output nor one of its own buffers ('<node>:buf<k>')."
                    )
                defined.add(sid)


def _check_int(value: Any, what: str, bound: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(f"{what} must be an int, got {short(value)}.")
    if value < 0 or value > bound:
        raise _fail(f"{what} = {value} is out of range [0, {bound}].")
