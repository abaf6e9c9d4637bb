"""Hierarchical solving for graphs made of repeated blocks (transformer layers, ResNet stages).

Real models have thousands of ops, too many for one flat integer program, but they repeat a
block. With every region kept inside one segment (prologue, block, epilogue), the peak of the
step is ``max_j (P_j + sum_{i<j} K_i)`` (see :mod:`chkpt_opt.solvers.blocks.repeated`), and the
schedule is found in two levels:

1. **Blocks**: for every distinct segment (identical blocks share it) a CP-SAT sub-problem is
   solved once per cap on its own peak ``P``: the least recompute for a spread of bounds on
   ``K`` (an epsilon-constraint sweep). The caps are spread between the block's lowest and
   keep-all peaks, then refined at the caps the chain's solution imposes
   (``P_j <= budget - sum_{i<j} K_i``), for up to ``refine_rounds`` rounds.
2. **Chain**: dynamic programming over the chain of segments, with the bytes kept so far as
   the state (Pareto-pruned), picks one option per segment under the budget.

Both levels are repeated for up to ``max_phases`` shifted cuttings of the chain (the block
boundaries moved by a few ops, so regions may straddle the original ones); the best wins.

The result is optimal only among the schedules built from the block options; it is never
reported optimal for the full schedule model (status ``feasible``, no bound) and ``stats``
says so. The peak the chain predicts must equal the simulated one (checked). The block
programs, sweeps, chain DP and polish are :mod:`~chkpt_opt.solvers.blocks.options`; this
module cuts the graph, runs the phases and judges the result. Nothing here is registered:
solver ``hierarchical`` (:mod:`chkpt_opt.solvers.blocks.hierarchical`) runs it on its own, and the
pruned search takes it as part of its incumbent
(:func:`chkpt_opt.solvers.keepset.warm_start.block_incumbent`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import MemoryProfile, simulate
from chkpt_opt.solvers.base import SolveResult, result_from_profile
from chkpt_opt.solvers.blocks.options import Option, OptionPool, chain_dp, polish, sweep_together
from chkpt_opt.solvers.blocks.repeated import (
    Blocks,
    Segment,
    evaluate,
    find_blocks,
    fold_shared_lifetimes,
    phase_shifts,
    split_model,
)
from chkpt_opt.solvers.deadline import Deadline, DeadlineExceeded
from chkpt_opt.solvers.heuristics.greedy_sweep import greedy_sweep
from chkpt_opt.solvers.interval.builder import build_interval_model
from chkpt_opt.solvers.interval.judge import judged
from chkpt_opt.solvers.interval.model import IntervalModel


@dataclass
class _Phase:
    """One cutting of the chain, solved."""

    blocks: Blocks
    model: IntervalModel
    exact: IntervalModel
    folded: int
    segments: list[Segment]
    options: list[list[Option]]
    picked: tuple[float, list[int]] | None
    solves: int
    refine_rounds: int

    def chosen(self, picks: Sequence[int]) -> list[int]:
        return [k for j, o in enumerate(picks) for k in self.options[j][o].chosen]

    def predicted_peak(self, picks: Sequence[int]) -> int:
        kept, peak = 0, 0
        for j, o in enumerate(picks):
            peak = max(peak, self.options[j][o].peak_bytes + kept)
            kept += self.options[j][o].kept_bytes
        return peak


@dataclass(frozen=True)
class BlockSearch:
    """The settings of the block search (see the module docstring).

    Attributes:
        peak_levels: caps on a block's own peak swept per distinct segment at first.
        n_kept: bounds on the kept bytes swept per cap.
        refine_rounds: rounds of sweeps at the caps the chain's solution imposes.
        max_phases: shifted cuttings of the chain tried besides the module boundaries.
        polish_max_segments: chains of at most this many segments get a final CP-SAT over
            all segments at once, hinted with the chain's solution (see :func:`polish`).
        polish_s: time limit of that final solve.
        seed: CP-SAT seed of the block sub-problems.
    """

    peak_levels: int = 8
    n_kept: int = 12
    refine_rounds: int = 3
    max_phases: int = 3
    polish_max_segments: int = 16
    polish_s: float = 20.0
    seed: int = 0

    def search(
        self, graph: CostGraph, budget_bytes: int, *, deadline: Deadline, solver: str
    ) -> SolveResult:
        """The two-level search of the module docstring on ``graph`` under ``budget_bytes``.

        Raises:
            SolverError: when the graph has no repeated blocks, or no cutting of it splits
                its memory.
        """
        blocks = find_blocks(graph)
        if blocks is None:
            raise SolverError(
                f"graph {graph.graph.get('name', '')!r} has no repeated blocks (no ops whose "
                "module_path has a '<name>.<k>' prefix repeated); use solver 'cpsat' or 'auto'."
            )
        phases: list[_Phase] = []
        refused: dict[int, str] = {}
        out_of_time = False
        for cutting in [blocks, *phase_shifts(graph, blocks, max_phases=self.max_phases)]:
            if phases and deadline.share(0.5).expired():
                break
            try:
                phases.append(self._solve_phase(graph, cutting, budget_bytes, deadline))
            except DeadlineExceeded as err:
                refused[cutting.phase] = str(err)
                out_of_time = True
                break
            except SolverError as err:
                refused[cutting.phase] = str(err)
        if not phases and out_of_time:  # the time limit is a promise: greedy's schedule
            fallback = greedy_sweep(graph, budget_bytes, time_limit_s=deadline.remaining_s())
            return dataclasses.replace(
                fallback,
                solver=solver,
                solve_s=deadline.elapsed_s(),
                stats={**fallback.stats, "timed_out": True, "phases_refused": refused},
            )
        if not phases:
            raise SolverError(f"no cutting of the graph into blocks splits its memory: {refused}")
        solved = [p for p in phases if p.picked is not None]
        stats: dict[str, Any] = {
            "optimal_over": "schedules with regions inside blocks, built from the block options",
            "phases_tried": [p.blocks.phase for p in phases],
            "phases_refused": refused,
            "segments": len(phases[0].blocks.bounds) - 1,
            "distinct_blocks": len(set(phases[0].blocks.kinds)),
            "block_solves": sum(p.solves for p in phases),
        }
        if solved:
            best = min(solved, key=lambda p: (p.picked[0], p.blocks.phase))
            picks = best.picked[1]
            chosen = best.chosen(picks)
            schedule, profile = judged(graph, best.exact, chosen)
            predicted = best.predicted_peak(picks)
            # Folded shared storages may over-state the peak, never under-state it.
            if predicted < profile.peak_bytes or (
                not best.folded and predicted != profile.peak_bytes
            ):
                raise SolverError(
                    f"the block split predicted a peak of {predicted} B, the "
                    f"simulator {profile.peak_bytes} B; this is a bug in chkpt_opt, please "
                    "report it."
                )
            if len(best.segments) <= self.polish_max_segments:
                left = self.polish_s
                remaining = deadline.remaining_s()
                if remaining is not None:
                    left = min(left, remaining)
                polished = (
                    polish(
                        best.model,
                        best.segments,
                        budget_bytes,
                        hint=chosen,
                        time_limit_s=left,
                        seed=self.seed,
                    )
                    if left > 0
                    else None
                )
                if polished is not None:
                    stats["optimal_in_block_model"] = polished[1]
                    if best.model.cost_s(polished[0]) < profile.recompute_s:
                        schedule, profile = judged(graph, best.exact, polished[0])
                        stats["polished"] = True
            stats["phase"] = best.blocks.phase
            stats["options"] = sum(len(o) for o in best.options)
            stats["refine_rounds"] = best.refine_rounds
        else:
            schedule, profile = self._lowest(graph, budget_bytes, phases[0], deadline.remaining_s())
        return result_from_profile(
            schedule,
            profile,
            budget_bytes=budget_bytes,
            solver=solver,
            solve_s=deadline.elapsed_s(),
            stats=stats,
        )

    def _solve_phase(
        self,
        graph: CostGraph,
        blocks: Blocks,
        budget_bytes: int,
        deadline: Deadline,
    ) -> _Phase:
        deadline.check("the block search's interval model")  # it is not cut once started
        exact = build_interval_model(graph, segments=blocks.bounds)
        model, folded = fold_shared_lifetimes(exact, blocks)
        segments = split_model(model, blocks)
        pools: dict[int, OptionPool] = {}
        first = {kind: seg for seg, kind in reversed(list(zip(segments, blocks.kinds)))}
        ordered = sorted(first.items(), key=lambda item: item[1].lo)
        for k, (kind, seg) in enumerate(ordered):
            # Every distinct block's program, each first solve with half of the time left,
            # shared by the blocks' sizes (their candidate intervals): programs still to
            # build need time too, and a prologue of a few ops needs little of it.
            deadline.check("building the block search's per-block programs")
            left = deadline.remaining_s()
            weights = [len(s.intervals) + 1 for _, s in ordered[k:]]
            share = None if left is None else left * weights[0] / (2 * sum(weights))
            pools[kind] = OptionPool(
                model,
                seg,
                seed=self.seed,
                deadline=deadline,
                first_deadline=Deadline.after(share),
            )
        # Then the sweeps share what time is left.
        sweep_together(list(pools.values()), self.peak_levels, n_kept=self.n_kept)

        def tables() -> list[list[Option]]:
            index = {(iv.start, iv.stop): k for k, iv in enumerate(model.intervals)}
            options = []
            for seg, kind in zip(segments, blocks.kinds):
                row = []
                for spans in pools[kind].found:
                    chosen = tuple(index[a + seg.lo, b + seg.lo] for a, b in spans)
                    peak, kept, cost = evaluate(model, seg, chosen)
                    row.append(Option(chosen, cost, kept, peak))
                options.append(row)
            return options

        options = tables()
        picked = chain_dp(options, budget_bytes)
        rounds = 0
        while rounds < self.refine_rounds and not deadline.expired():
            before = sum(len(pool.found) for pool in pools.values())
            if picked is None:
                sweep_together(list(pools.values()), 2 * self.peak_levels, n_kept=self.n_kept)
            else:
                kept = 0
                for j, o in enumerate(picked[1]):
                    pools[blocks.kinds[j]].sweep(budget_bytes - kept, n_kept=self.n_kept)
                    kept += options[j][o].kept_bytes
            rounds += 1
            if sum(len(pool.found) for pool in pools.values()) == before:
                break
            options = tables()
            better = chain_dp(options, budget_bytes)
            improved = better is not None and (picked is None or better[0] < picked[0])
            picked = better if improved else picked
            if not improved:
                break
        solves = sum(pool.solves for pool in pools.values())
        return _Phase(blocks, model, exact, folded, segments, options, picked, solves, rounds)

    def _lowest(
        self, graph: CostGraph, budget_bytes: int, phase: _Phase, time_limit_s: float | None
    ) -> tuple[Schedule, MemoryProfile]:
        """The lowest-peak schedule known: per segment greedily, or greedy's if lower."""
        picks, kept = [], 0
        for row in phase.options:
            o = min(range(len(row)), key=lambda i: (row[i].peak_bytes + kept, row[i].kept_bytes))
            picks.append(o)
            kept += row[o].kept_bytes
        schedule, profile = judged(graph, phase.exact, phase.chosen(picks))
        fallback = greedy_sweep(graph, budget_bytes, time_limit_s=time_limit_s)
        if fallback.peak_bytes < profile.peak_bytes:
            return fallback.schedule, simulate(graph, fallback.schedule)
        return schedule, profile
