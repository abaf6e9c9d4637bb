"""Is the recompute bound's gap on the Llamas its LP relaxation? Its program solved in integers.

Run (from the repository root):
    OMP_NUM_THREADS=1 python benchmarks/results/bound_looseness/integer_cover.py \
        > benchmarks/results/bound_looseness/integer_cover.jsonl

The recompute bound (:mod:`chkpt_opt.solvers.bounds.recompute_bound`) is an LP whose
variables are yes-or-no in every schedule (an op recomputed after a step, a storage alive
at it), so the same program in integers is also a relaxation of every schedule, and its
optimum a bound at least as high. Here it is solved by SCIP with the same cutting planes
(the rows the integer solution violates added until none is), on the Hugging Face Llama of
2 and 6 layers at its layers' peak and halfway to the floor (``benchmarks/hf_gaps.py``'s
budgets), beside the LP's bound. One JSON line per model and budget. Then the time-indexed
bound's program (:mod:`chkpt_opt.solvers.bounds.timed_bound`) in integers on the 2-layer
Llama halfway, SCIP for :data:`LIMIT_S`: its best schedule-like point and its proven bound.
With ``--families gpt2 bert mixtral``: those families at their default size instead (the
integer programs only).
"""

from __future__ import annotations

import argparse
import json
import time

from ortools.linear_solver import pywraplp

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.tracer import trace_model
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.own_layouts import own_layouts
from chkpt_opt.solvers.bounds import recompute_bound as cover_module
from chkpt_opt.solvers.bounds import timed_bound as timed_module
from chkpt_opt.solvers.bounds.bound_rows import KeepAllRows
from chkpt_opt.solvers.deadline import Deadline
from chkpt_opt.zoo import huggingface as hf_zoo

LIMIT_S = 120.0
"""Seconds for each integer solve."""


class _IntegerCover(cover_module._CoverLp):
    """The recompute bound's program with every variable an integer in [0, 1], in SCIP."""

    def __init__(self, rows: KeepAllRows, budget_bytes: int) -> None:
        super().__init__(rows, budget_bytes)
        solver = pywraplp.Solver.CreateSolver("SCIP")
        solver.NumVar = lambda lb, ub, name: solver.IntVar(lb, ub, name)  # binaries
        self.solver = solver


def _integer_bound(rows: KeepAllRows, budget_bytes: int) -> tuple[float | None, int, float]:
    """The integer optimum (seconds; None where a solve did not finish), rows added, time."""
    start = time.perf_counter()
    program = _IntegerCover(rows, budget_bytes)
    over = [r for r in rows.rows if r.during_bytes > budget_bytes]
    pending = sorted(over, key=lambda r: (r.fixed_bytes - r.during_bytes, r.position))
    value = None
    while pending:
        for row in pending[:8]:
            program.add(row)
        value = program.solve(Deadline.after(LIMIT_S))
        if value is None:
            break
        pending = program.violated(over) or []
    return value, program.n_rows, time.perf_counter() - start


class _IntegerTimed(timed_module._Program):
    """The time-indexed program with every variable an integer in [0, 1], in SCIP."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        solver = pywraplp.Solver.CreateSolver("SCIP")
        solver.NumVar = lambda lb, ub, name: solver.IntVar(lb, ub, name)  # binaries
        solver.SetSolverSpecificParametersAsString = lambda _: True  # HiGHS's, not SCIP's
        solver.SetNumThreads = lambda _: True
        create = pywraplp.Solver.CreateSolver
        pywraplp.Solver.CreateSolver = staticmethod(lambda _: solver)
        try:
            super().__init__(*args, **kwargs)
        finally:
            pywraplp.Solver.CreateSolver = create

    def solve(self, deadline: Deadline) -> float | None:
        self.solver.SetTimeLimit(int(LIMIT_S * 1000))
        start = time.perf_counter()
        status = self.solver.Solve()
        objective = self.solver.Objective()
        print(
            json.dumps(
                {
                    "model": "llama2",
                    "budget": "halfway",
                    "timed_integer_status": "optimal" if status == 0 else str(status),
                    "timed_integer_best_point_ms": round(objective.Value() * 1e3, 3),
                    "timed_integer_bound_ms": round(objective.BestBound() * 1e3, 3),
                    "timed_integer_s": round(time.perf_counter() - start, 1),
                }
            ),
            flush=True,
        )
        return objective.BestBound()


def _graphs(families: list[str]) -> list[tuple[str, CostGraph]]:
    """The Llama of 2 and 6 layers (no ``families``), or each family at its default size."""
    if not families:
        built = [(f"llama{n}", hf_zoo.FAMILIES["llama"](layers=n)) for n in (2, 6)]
    else:
        built = [(family, hf_zoo.FAMILIES[family]()) for family in families]
    return [(name, trace_model(m, a, name=name).graph) for name, (m, a, _) in built]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--families",
        nargs="*",
        default=[],
        choices=list(hf_zoo.FAMILIES),
        help="these families at their default size instead of the two Llamas",
    )
    for name, graph in _graphs(parser.parse_args().families):
        peak = simulate(graph, own_layouts(graph)["layers"]).peak_bytes
        floor = cover_module.recompute_bound(graph, peak).floor_bytes
        rows = cover_module.keep_all_rows(graph)
        for label, lower in (("layers' peak", 0.0), ("halfway", 0.5)):
            budget = int(peak - lower * (peak - floor))
            relaxed = cover_module.recompute_bound(graph, budget)
            value, steps, seconds = _integer_bound(rows, budget)
            row = {
                "model": name,
                "ops": graph.number_of_nodes(),
                "budget": label,
                "lp_bound_ms": None if relaxed.bound_s is None else round(relaxed.bound_s * 1e3, 3),
                "integer_bound_ms": None if value is None else round(value * 1e3, 3),
                "integer_steps": steps,
                "integer_s": round(seconds, 1),
            }
            print(json.dumps(row), flush=True)
            if name == "llama2" and lower == 0.5:
                program, timed_module._Program = timed_module._Program, _IntegerTimed
                try:
                    timed_module.timed_bound(graph, budget)
                finally:
                    timed_module._Program = program


if __name__ == "__main__":
    main()
