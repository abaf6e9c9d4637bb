"""Facts of a graph computed once while a search holds the graph unchanged.

A local search simulates thousands of schedules of one graph, and each simulation sorts
the graph's nodes, maps storages to their owners, reads the allowed cuts, ... again: on
a padded Llama of 323 ops that was a third of the cached-op search's time. Inside
``with frozen(graph):`` the functions marked :func:`graph_fact` compute their answer for
that graph once and hand out copies; outside it (and for any other graph) they compute it
every call, as before. The caller promises not to change the graph inside the block (a
solver's search does not).

Example:
    >>> from chkpt_opt.graphs.costgraph import ordered_nodes
    >>> from chkpt_opt.graphs.synthetic import chain_graph
    >>> g = chain_graph(3)
    >>> with frozen(g):
    ...     ordered_nodes(g) == ordered_nodes(g)
    True
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import networkx as nx

R = TypeVar("R")

_MEMOS: dict[int, dict[str, Any]] = {}
"""For each graph inside a ``frozen`` block (by ``id``), the facts computed so far."""


@contextmanager
def frozen(graph: nx.DiGraph) -> Iterator[None]:
    """Computes each :func:`graph_fact` of ``graph`` once until the block ends (nested
    blocks on the same graph share the outermost one's facts)."""
    key = id(graph)
    if key in _MEMOS:
        yield
        return
    _MEMOS[key] = {}
    try:
        yield
    finally:
        del _MEMOS[key]


def graph_fact(fn: Callable[[Any], R]) -> Callable[[Any], R]:
    """Marks ``fn(graph)`` as a fact of the graph alone: computed once per ``frozen``
    block, a shallow copy handed out each call (callers may change what they get)."""
    name = f"{fn.__module__}.{fn.__qualname__}"

    @functools.wraps(fn)
    def fact(graph: Any) -> R:
        memo = _MEMOS.get(id(graph))
        if memo is None:
            return fn(graph)
        if name not in memo:
            memo[name] = fn(graph)
        return copy.copy(memo[name])

    return fact


def frozen_memo(graph: Any) -> dict[str, Any] | None:
    """The memo of ``graph``'s ``frozen`` block, where a search keeps what it would
    otherwise compute twice in it (a result of the graph and its own arguments, under a key
    that names them all); None outside a block, where nothing is kept."""
    return _MEMOS.get(id(graph))
