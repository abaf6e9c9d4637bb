"""Lossless, versioned JSON form of a CostGraph, and atomic file writes.

The file is plain JSON (never pickle)::

    {"format": "chkpt_opt.costgraph", "format_version": 1,
     "graph": {...graph attributes...},
     "nodes": [{"name": "linear", "index": 0, ...}, ...],   # in execution order
     "edges": [["linear", "relu"], ...]}
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import networkx as nx

from chkpt_opt.errors import GraphFormatError, short
from chkpt_opt.graphs.costgraph import (
    FORMAT_VERSION,
    NODE_ATTRS,
    CostGraph,
    check_graph,
    ordered_nodes,
)

GRAPH_FORMAT = "chkpt_opt.costgraph"
MAX_FILE_BYTES = 1 << 30


def graph_to_dict(graph: CostGraph) -> dict[str, Any]:
    """Returns the JSON-ready dict of a CostGraph (nodes in execution order)."""
    check_graph(graph)
    order = ordered_nodes(graph)
    nodes = []
    for name in order:
        attrs = graph.nodes[name]
        entry: dict[str, Any] = {"name": name}
        for key in NODE_ATTRS:
            value = attrs[key]
            entry[key] = dict(value) if isinstance(value, dict) else value
        nodes.append(entry)
    position = {name: i for i, name in enumerate(order)}
    edges = sorted(
        graph.edges(data="uses", default=1), key=lambda e: (position[e[0]], position[e[1]])
    )
    return {
        "format": GRAPH_FORMAT,
        "format_version": FORMAT_VERSION,
        "graph": dict(graph.graph),
        "nodes": nodes,
        # [u, v] when v reads u once, [u, v, uses] otherwise
        "edges": [[u, v] if uses == 1 else [u, v, uses] for u, v, uses in edges],
    }


def graph_from_dict(data: Any, *, source: str = "cost graph") -> CostGraph:
    """Rebuilds a CostGraph from :func:`graph_to_dict`'s output, checking everything.

    Raises:
        GraphFormatError: if the data is not a cost graph of this format version.
    """
    if not isinstance(data, dict) or data.get("format") != GRAPH_FORMAT:
        raise GraphFormatError(
            f"{source} is not a chkpt_opt cost graph (expected a JSON object with "
            f'"format": "{GRAPH_FORMAT}"); make one with `chkpt-opt trace`.'
        )
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise GraphFormatError(
            f"{source} has format_version {short(version)}; this chkpt_opt reads version "
            f"{FORMAT_VERSION}. Regenerate the file with `chkpt-opt trace` (or the corpus "
            "command) of this version."
        )
    for key, kind in (("graph", dict), ("nodes", list), ("edges", list)):
        if not isinstance(data.get(key), kind):
            raise GraphFormatError(f"{source}: field {short(key)} must be a JSON {kind.__name__}.")
    graph = nx.DiGraph()
    graph.graph.update(data["graph"])
    for entry in data["nodes"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise GraphFormatError(
                f"{source}: every node needs a string 'name', got {entry!r:.80}."
            )
        name = entry["name"]
        if name in graph:
            raise GraphFormatError(f"{source}: node {short(name)} appears twice.")
        attrs = {k: v for k, v in entry.items() if k != "name"}
        unknown = sorted(set(attrs) - set(NODE_ATTRS))
        if unknown:
            raise GraphFormatError(
                f"{source}: node {short(name)} has unknown attributes {unknown}."
            )
        graph.add_node(name, **attrs)
    for edge in data["edges"]:
        if (
            not isinstance(edge, list)
            or len(edge) not in (2, 3)
            or not all(isinstance(x, str) and x in graph for x in edge[:2])
        ):
            raise GraphFormatError(
                f"{source}: edge {edge!r:.80} must be [u, v] or [u, v, uses] with known node names."
            )
        if edge[0] == edge[1] or graph.has_edge(edge[0], edge[1]):
            raise GraphFormatError(f"{source}: edge {edge!r:.80} is a self-loop or a duplicate.")
        if len(edge) == 3:
            graph.add_edge(edge[0], edge[1], uses=edge[2])
        else:
            graph.add_edge(edge[0], edge[1])
    try:
        check_graph(graph)
    except GraphFormatError as err:
        raise GraphFormatError(f"{source}: {err}") from None
    return graph


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        twice = sorted({k for k in keys if keys.count(k) > 1})
        raise GraphFormatError(f"key {short(twice[0])} appears twice in one JSON object.")
    return dict(pairs)


def _reject_constant(token: str) -> Any:
    raise GraphFormatError(f"JSON constant {token} is not allowed in chkpt_opt files.")


def read_json(path: str | Path, *, what: str) -> Any:
    """Reads a JSON file with clear errors for missing, oversized or malformed files."""
    path = Path(path)
    if not path.is_file():
        raise GraphFormatError(f"{what} {str(path)!r} does not exist or is not a file.")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise GraphFormatError(f"{what} {str(path)!r} is {size} bytes, over the 1 GiB limit.")
    try:
        with path.open("r", encoding="utf-8") as handle:
            return json.load(
                handle, parse_constant=_reject_constant, object_pairs_hook=_no_duplicate_keys
            )
    except UnicodeDecodeError as err:
        raise GraphFormatError(f"{what} {str(path)!r} is not UTF-8 text: {err}.") from None
    except json.JSONDecodeError as err:
        raise GraphFormatError(
            f"{what} {str(path)!r} is not valid JSON (line {err.lineno}, column {err.colno}: "
            f"{err.msg}); the file may be truncated."
        ) from None
    except RecursionError:
        raise GraphFormatError(f"{what} {str(path)!r} is nested too deeply.") from None
    except GraphFormatError as err:
        raise GraphFormatError(f"{what} {str(path)!r}: {err}") from None
    except ValueError as err:  # e.g. integers beyond Python's digit limit
        raise GraphFormatError(f"{what} {str(path)!r} holds an unreadable value: {err}.") from None


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Writes JSON to ``path`` through a temporary file, so a crash leaves no half file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=1, sort_keys=False, allow_nan=False)
            handle.write("\n")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes files private; give them the usual mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_graph(graph: CostGraph, path: str | Path) -> None:
    """Saves a CostGraph as JSON (atomically)."""
    write_json_atomic(path, graph_to_dict(graph))


def load_graph(path: str | Path) -> CostGraph:
    """Loads and checks a CostGraph JSON file."""
    return graph_from_dict(
        read_json(path, what="cost graph file"), source=f"cost graph file {str(path)!r}"
    )


def graph_fingerprint(graph: CostGraph) -> str:
    """A short hash of what a schedule depends on: op names, order, edges and output sizes.

    Two traces of the same model with the same input shapes have the same fingerprint; a
    different model, or other shapes, almost surely not.
    """
    import hashlib

    order = ordered_nodes(graph)
    digest = hashlib.sha256()
    for name in order:
        attrs = graph.nodes[name]
        digest.update(f"{name}|{attrs['op']}|{sorted(attrs['outputs'].items())}\n".encode())
    for u, v in sorted(graph.edges):
        digest.update(f"{u}->{v}\n".encode())
    return digest.hexdigest()[:16]
