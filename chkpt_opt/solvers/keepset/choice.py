"""Which exact keep-set solver fits a graph: what ``auto`` runs after the heuristics
(:func:`pick_exact`; the names are registered solvers, ``auto`` looks them up).

* ``enumerate`` when the graph has at most ``enumerate_max_schedules`` valid schedules;
* ``dp_chain`` when every allowed cut position of the graph can be a boundary of its chain
  of segments (a chain of ops, a DAG cut at articulation points): exact, and fast on long
  chains; ``cpsat`` if it refuses the graph;
* ``pruned`` when the graph has more than ``pruned_min_positions`` allowed cuts and at most
  ``pruned_max_ops`` ops: an incumbent from greedy and (on repeated blocks) the block
  search, then the MILP over every cut after exact pruning
  (:mod:`chkpt_opt.solvers.keepset.pruned_search`); measured on the corpus graphs of
  184-298 ops at budgets 0.9-0.3 of the keep-all peak: proven optimal within 60 s, where the
  flat solvers over a subset of cuts had no bound. From 64 cuts on it also beats flat CP-SAT
  over every cut (``python benchmarks/auto_choice.py --time-limit 8``): on unet_large,
  resnet_large and gpt_small (68-93 cuts) at 0.9 and 0.7 of the keep-all peak it proved all
  six optima in 3.0-4.0 s, where flat CP-SAT proved one and returned up to 86 times the
  optimum (resnet_large at 0.9: 576 ms against 6.7 ms); below that flat CP-SAT is faster
  (encoder_small and vit_small, 47-51 cuts: 1.4-2.7 s against 3.0-4.2 s, all proven). Out
  of time, it returns its incumbent;
* ``hierarchical`` on larger graphs made of repeated blocks (feasible, not proven optimal:
  it keeps regions inside blocks); ``cpsat`` if it refuses the graph;
* ``cpsat`` otherwise (over a candidate subset of cuts on very large graphs, then never
  reported optimal).
"""

from __future__ import annotations

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.memory_model.schedule import cut_positions
from chkpt_opt.solvers.blocks.repeated import find_blocks
from chkpt_opt.solvers.chain.cuts import is_chain

PRUNED_MIN_POSITIONS = 64
"""Graphs with more allowed cuts than this (and at most ``PRUNED_MAX_OPS`` ops) go to the pruned
every-cut solver rather than to flat CP-SAT (measured in the module docstring)."""
PRUNED_MAX_OPS = 600
"""Largest graph ``auto`` gives the pruned every-cut solver (it covers the 586-op gpt_large,
proven optimal there at budgets 0.9 and 0.5 in 60 s; at 0.3 it returns its incumbent)."""


def count_schedules(graph: CostGraph) -> int:
    """Number of valid keep-set schedules of ``graph`` (the empty one included)."""
    ok = cut_positions(graph)
    n = len(ok) - 1
    ways = [0] * (n + 1)  # ways[p]: schedules of the ops from position p on
    ways[n] = 1
    for p in range(n - 1, -1, -1):
        ways[p] = ways[p + 1]
        if ok[p]:
            ways[p] += sum(ways[q] for q in range(p + 1, n + 1) if ok[q])
    return ways[0]


def pick_exact(
    graph: CostGraph,
    *,
    enumerate_max_schedules: int,
    flat_max_positions: int | None,
    pruned_max_ops: int = PRUNED_MAX_OPS,
    pruned_min_positions: int | None = PRUNED_MIN_POSITIONS,
) -> list[str]:
    """The exact solvers that fit ``graph``, best first (see the module docstring); the next
    one runs only if the first refuses the graph."""
    if count_schedules(graph) <= enumerate_max_schedules:
        return ["enumerate"]
    if is_chain(graph):
        return ["dp_chain", "cpsat"]
    n_cuts = sum(cut_positions(graph)) - 2
    small = graph.number_of_nodes() <= pruned_max_ops
    if small and pruned_min_positions is not None and n_cuts > pruned_min_positions:
        return ["pruned", "cpsat"]
    if flat_max_positions is not None and n_cuts > flat_max_positions:
        if small:
            return ["pruned", "cpsat"]
        if find_blocks(graph):
            return ["hierarchical", "cpsat"]
    return ["cpsat"]
