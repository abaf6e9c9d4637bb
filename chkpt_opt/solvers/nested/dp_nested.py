"""Exact dynamic programming over nested (multi-level) schedules of a chain:
``solver="dp_nested"``.

Rotor (Beaumont et al., "Optimal checkpointing for heterogeneous chains", 2019) finds the
cheapest multi-level schedule of a heterogeneous chain by a recurrence over spans and
memory: a span's backward is either everything stored, or a first part kept as a checkpoint
while the rest is solved with less memory, then the first part solved with its own memory.
This module does the same for the schedules that PyTorch's nested non-reentrant checkpoints
execute, with the memory of every step exactly as :func:`chkpt_opt.memory_model.op_sequence.lower`
(and so the simulator) counts it: gradients alive, what plain ops save, what a checkpoint holds,
the inputs of nested regions held while they run, replays outer-first with their early
stop, the tail of backward steps before a replay. The
recurrence is :mod:`~chkpt_opt.solvers.nested.recurrence`; the chain's facts
:mod:`~chkpt_opt.solvers.nested.unit_chain`.

**Claim.** On a *simple chain* (each op reads the previous op's output and owns one output,
views of that output and buffers of its own aside, as in VGG-like conv nets; see
:mod:`~chkpt_opt.solvers.nested.unit_chain`), the result is ``optimal`` over nested schedules
whose region boundaries are allowed cuts between an op's views and the next op, that cache
nothing (no selective-checkpoint policy), and whose regions each contain an op that saves
something (a region without one is never recomputed and never helps);
``stats["optimal_over"]`` says so. This space contains
every keep-set schedule worth having, so a full solve is never costlier than
``dp_chain``'s keep-set optimum. The status is ``optimal`` only when the full solve (all
allowed cuts) finished and the peak and recompute time the DP predicts for the returned
schedule equal the simulator's (they must: a mismatch raises
:class:`~chkpt_opt.errors.SolverError`, a bug). Memory is exact bytes, never discretized.
For an infeasible budget, the same DP minimizing the peak finds the lowest peak of the
space, and the cheapest schedule at that peak is returned, with ``proves_infeasible``.
A profiled graph's ``region_overhead_s`` is charged to every region, nested ones and a
block option's included, once each, as the simulator charges it (on CUDA, where
``plan`` profiles by default).
**Blocks.** A graph that is no simple chain is planned as the chain of its blocks between
separators (cuts that one storage crosses, beside the broadcast storages that most
layers read: a transformer's residual stream between its halves of blocks), each block's
step bytes read off the op sequence
(:mod:`~chkpt_opt.solvers.nested.separator_chain`; ``blocks=False`` refuses such graphs). The space
is then nested schedules with region boundaries at separators (``SEPARATOR_SPACE``), coarser
than keep-set's cuts, so ``auto`` runs it only where no keep-set schedule fits. Where a
block's bytes depend on how its input is held (its input freed before the block's peak
step, as GPT's position ids), the DP counts them conservatively (``stats["model"]``), at
most ``stats["slack_bytes"]`` above the simulator: its plans fit as simulated, and its
optimum at the budget plus that slack bounds the optimum of the space (proven where the
two meet; the lowest peak's bound is the DP's less the slack). What the DP proves over
blocks holds over that space alone, which leaves keep-set schedules with other cuts out:
it is reported in ``stats["space_proof"]``, never as the result's status or bound. A
block may also run a keep-set schedule of its own (nested in the regions around it; the
model is then conservative by the inputs its regions hold), chosen among the options
that the hierarchical solver's block programs find (once per distinct block, with
``options_share`` of the time limit), each option's bytes read off the op sequence too
(:mod:`~chkpt_opt.solvers.nested.unit_options`; ``block_options=False`` leaves them out, and
``stats["block_options"]`` counts them). Other graphs are refused with a
:class:`~chkpt_opt.errors.SolverError` (use ``nested`` or ``auto``).

Costs: per region span and way its input is held, a DP over its pieces (``O(cuts)`` per
position and Pareto entry) per memory budget it is asked for, memoized over budget ranges:
``O(cuts^2 * ops)`` frame work. On a chain with more allowed cuts than the counts of
``coarse_cuts``, first solves over every k-th allowed cut (at every phase of k and of
k - 1, ``coarse_phases``) give quick incumbents
(``feasible``, their space named in ``stats["optimal_over"]``), kept when the time limit
cuts the full solve short. A 120-op heterogeneous chain takes 0.5 s over 12 cuts and 16 s
over 21; its full solve is out of reach of a short time limit (``dp_chain`` is the exact
solver there for keep-set schedules).
Measured on 2 cores, the zoo's 32-layer linear+ReLU chain (66 ops, 67 cuts) at 0.75x its
smallest keep-set step budget: the coarse solve (23 cuts) gives recompute 0.91 s in seconds;
the full solve in 85 s, optimal at 0.74 s (the ``nested`` heuristic: 1.85 s); its smallest
activation peak, 20.0 MiB (keep-set: 40.3 MiB), is found and proven in 6.6 s (climbing from
the floor, ``PEAK_STEPS``; descending from an unbudgeted peak-minimizing solve had reached
23.3 MiB without a proof after 400 s). The zoo's VGG at 64² images (31 ops, 30 units): a
budget solve in 4-18 s, its smallest peak proven in 8 s
(``python benchmarks/general_space.py --parts conv_nets``). One DP per set of cuts and
objective serves a whole call, so the lowest-peak search reuses the frames of its earlier
budgets: on the deep chain 28.5 k frames solved instead of 39.4 k, 0.81 ± 0.08 of the
time, the VGG's searches unchanged within the noise, the same answers everywhere
(``python benchmarks/dp_nested_speed.py --against b2bb4e4 --repeats 3``). Building each
unit's ways once per chain and extending whole fronts at once took the VGG's solves to
0.76-0.81 of their time and ``gpt_reference`` over its blocks at 0.16 of keep-all from
17.6 s to 8.9 s (``--against b393419``; ``stats["frames_solved"]``). (Before the run
room was counted, the full solve took 15 s, and its plans with four levels of nesting
measured up to 27% above their prediction.)

Out of time (``time_limit_s``), it returns the best schedule found so far (the coarse
incumbent, or the lowest-peak one) with ``stats["timed_out"]`` and an honest status:
``feasible``, or ``timed_out`` when nothing that fits was found (then the keep-all
schedule when not even a lowest-peak plan was finished).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from chkpt_opt.errors import SolverError
from chkpt_opt.graphs.costgraph import CostGraph, region_overhead_s
from chkpt_opt.memory_model.schedule import Schedule, check_schedule
from chkpt_opt.memory_model.simulate import MemoryProfile, simulate
from chkpt_opt.solvers.base import (
    INF_BYTES,
    SolveResult,
    SolveStatus,
    keep_all_result,
    result_from_profile,
)
from chkpt_opt.solvers.deadline import Deadline, DeadlineExceeded
from chkpt_opt.solvers.interval.judge import check_prediction
from chkpt_opt.solvers.nested.cut_stages import cut_stages
from chkpt_opt.solvers.nested.recurrence import NestedDp
from chkpt_opt.solvers.nested.separator_chain import UNITS, separator_chain
from chkpt_opt.solvers.nested.top_frame import top_plan
from chkpt_opt.solvers.nested.unit_chain import (
    NestedChain,
    Plan,
    lowest_peak_floor_bytes,
    plan_schedule,
    schedule_plan,
    simple_chain,
)
from chkpt_opt.solvers.nested.unit_options import with_options
from chkpt_opt.solvers.registry import register

PEAK_STEPS = 20
"""The lowest-peak search climbs from a floor in steps of 1/20 of the budget (module
docstring): a budget below every plan is refused in a fraction of a second, a loose one
takes the DP longest (the 30-unit VGG of the zoo at 64² images: 8 s to the lowest peak
and its proof, where starting without a budget took 20 s and stopped 25% above it)."""

SPACE = (
    "nested schedules whose region boundaries are allowed cuts (none between an op and a "
    "view of its output), that cache nothing, and whose regions each hold an op that saves "
    "something"
)
SEPARATOR_SPACE = (
    "nested schedules whose region boundaries are separators (cuts that one storage "
    "crosses, beside the broadcast storages most layers read), that cache nothing, and "
    "whose regions each hold an op that saves something"
)


OPTIONS_SPACE = (
    ", with each block in no region running plain or one of its keep-set options (the "
    "block programs of the hierarchical solver)"
)


def chain_of(graph: CostGraph, *, blocks: bool = True, broadcast: bool = True) -> NestedChain:
    """The chain dp_nested plans ``graph`` as: a simple chain, or else (``blocks``) its
    blocks between separators (:mod:`~chkpt_opt.solvers.nested.separator_chain`; with
    ``broadcast``, storages most of the graph reads do not keep a cut from separating).

    Raises:
        SolverError: naming why ``graph`` is neither.
    """
    try:
        chain = simple_chain(graph)
    except SolverError as simple:
        if not blocks:
            raise
        try:
            chain = separator_chain(graph, broadcast=broadcast)
        except SolverError as blocks:
            raise SolverError(f"{simple} Nor as blocks: {blocks}") from None
    return dataclasses.replace(chain, region_s=region_overhead_s(graph))


def predict(graph: CostGraph, schedule: Schedule, *, broadcast: bool = True) -> tuple[int, float]:
    """Peak bytes and recompute time of ``schedule`` as the DP counts them (the tests check
    them against the simulator; ``broadcast`` as for :func:`chain_of`).

    Raises:
        SolverError: if ``graph`` is no simple chain, or the schedule caches ops or has a
            region without an op that saves something.
    """
    chain = chain_of(graph, broadcast=broadcast)
    return evaluate_plan(chain, schedule_plan(graph, chain, schedule))


def evaluate_plan(chain: NestedChain, plan: Plan) -> tuple[int, float]:
    """Peak bytes and recompute time of ``plan`` (its unit options included) as the DP
    counts them.

    Raises:
        SolverError: for a region without an op that saves something, or an option where
            the DP does not run one.
    """
    forced: dict[tuple[int, int] | None, set[tuple[int, int]]] = {None: set()}
    picks: dict[tuple[int, int] | None, dict[int, int]] = {}

    def walk(key: tuple[int, int] | None, children: Plan) -> None:
        forced.setdefault(key, set())
        for piece in children:
            if len(piece) == 2:
                picks.setdefault(key, {})[piece[0]] = piece[1]
                continue
            start, stop, inner = piece
            if chain.fp[start] >= stop:
                raise SolverError(
                    f"the region at ops {start}..{stop - 1} holds no op that saves anything: "
                    "outside dp_nested's space (such a region never helps)."
                )
            forced[key].add((start, stop))
            walk((start, stop), inner)

    walk(None, plan)
    found = top_plan(NestedDp(chain, forced=forced, forced_picks=picks), INF_BYTES)
    if found is None:
        raise SolverError("dp_nested could not evaluate the schedule; a bug.")
    cost, peak, _ = found
    return peak, cost


@register(
    "dp_nested",
    "exact DP over nested (multi-level) schedules of a simple chain, or of a graph's blocks",
)
@dataclass(frozen=True)
class DpNestedSolver:
    """Exact rotor-style DP over nested schedules of a simple chain (module docstring).

    Attributes:
        max_ops: refuse chains longer than this.
        coarse_cuts: on a chain with more allowed cuts than one of these counts, first
            solve over every k-th allowed cut (at most that many; quick incumbents, kept if
            the time limit cuts the full solve short), then over all of them.
        coarse_phases: also solve over every phase of each coarse stride and of the stride
            one shorter (:func:`~chkpt_opt.solvers.nested.cut_stages.cut_stages`).
        blocks: plan a graph that is no simple chain as its blocks between separators
            (:mod:`~chkpt_opt.solvers.nested.separator_chain`); False refuses it.
        block_options: over blocks, let a block in no region run a keep-set schedule of
            its own (:mod:`~chkpt_opt.solvers.nested.unit_options`).
        options_share: the fraction of the time limit the block options' programs get.
        broadcast: over blocks, leave storages that most of the graph reads (rotary
            tables, masks) out of what crosses a separator, and count them alive at every
            step (:func:`~chkpt_opt.solvers.nested.separator_chain.broadcast_storages`).
        seed: CP-SAT seed of those programs.
    """

    max_ops: int = 400
    coarse_cuts: tuple[int, ...] = (12, 24)
    coarse_phases: bool = True
    blocks: bool = True
    block_options: bool = True
    options_share: float = 0.25
    broadcast: bool = True
    seed: int = 0
    name: str = "dp_nested"

    def __call__(
        self, graph: CostGraph, budget_bytes: int, *, time_limit_s: float | None = None
    ) -> SolveResult:
        deadline = Deadline.after(time_limit_s)
        chain = chain_of(graph, blocks=self.blocks, broadcast=self.broadcast)
        space = SPACE if chain.units != UNITS else SEPARATOR_SPACE
        option_stats: dict[str, Any] = {}
        if chain.units == UNITS and self.block_options:
            chain = with_options(
                graph, chain, deadline=deadline.share(self.options_share), seed=self.seed
            )
            space += OPTIONS_SPACE
            option_stats["block_options"] = sum(map(len, chain.options))
        if chain.n > self.max_ops:
            raise SolverError(
                f"graph {graph.graph.get('name', '')!r} has {chain.n} ops, more than "
                f"max_ops={self.max_ops} of dp_nested; raise max_ops or use solver 'nested'."
            )
        facts = {
            **option_stats,
            "units": chain.units,
            "model": "exact" if chain.exact else "conservative",
            "slack_bytes": chain.slack_bytes,
        }
        trivial = keep_all_result(graph, budget_bytes, solver=self.name, deadline=deadline)
        if trivial is not None:  # nothing recomputed: optimal over every schedule
            stats = {**trivial.stats, **facts, "space": "general", "optimal_over": space}
            return dataclasses.replace(trivial, stats=stats)
        allowed = [p for p in range(chain.n + 1) if chain.ok[p]]
        stages, primary = cut_stages(allowed, chain.n, self.coarse_cuts, phases=self.coarse_phases)
        stats: dict[str, Any] = {"space": "general", "ops": chain.n, "cuts": len(allowed), **facts}
        found: list[tuple[Schedule, MemoryProfile, int]] = []  # (schedule, profile, cuts)
        # (schedule, profile, cuts, the DP's peak of it, whether the DP has none lower over
        # those cuts)
        lowest: list[tuple[Schedule, MemoryProfile, int, int, bool]] = []
        # One DP per set of cuts and objective: a frame's memoized answers hold for every
        # budget of the whole chain, so the solves below at other budgets reuse them.
        dps: dict[tuple[tuple[int, ...], bool], NestedDp] = {}

        def dp_for(cuts: list[int], minimize_peak: bool) -> NestedDp:
            key = (tuple(cuts), minimize_peak)
            if key not in dps:
                dps[key] = NestedDp(
                    chain, deadline=deadline, cuts=cuts, minimize_peak=minimize_peak
                )
            return dps[key]

        try:
            for cuts in stages:
                deadline.check("dp_nested's cut sets")
                plan = top_plan(dp_for(cuts, False), budget_bytes)
                if plan is not None:
                    found.append((*_judged(graph, chain, plan), len(cuts)))
            if not found:
                for cuts in primary:
                    # The peak-minimizing DP picks each region's plan by its own steps, not
                    # by what its run adds to its callers', so its plan may miss the lowest
                    # peak; under a budget it still finds a plan whenever one fits, and fast
                    # where none does. So it climbs from a floor under every plan's peak in
                    # steps of 1/PEAK_STEPS until a plan fits; then each budget one byte
                    # below the last plan's peak finds a lower plan, or proves that peak
                    # minimal; then the cheapest plan at that peak.
                    low = dp_for(cuts, True)
                    climb = lowest_peak_floor_bytes(chain)
                    while (plan := top_plan(low, climb)) is None:
                        deadline.check("dp_nested's climb to the lowest peak")
                        climb += max(1, climb // PEAK_STEPS)
                    while True:
                        lowest.append((*_judged(graph, chain, plan), len(cuts), plan[1], False))
                        deadline.check("dp_nested's descent from the lowest peak")
                        lower = top_plan(low, plan[1] - 1)
                        if lower is None:
                            break
                        plan = lower
                    cheapest = top_plan(dp_for(cuts, False), plan[1])
                    if cheapest is None:
                        raise SolverError("dp_nested lost the plan at its lowest peak; a bug.")
                    lowest[-1] = (*_judged(graph, chain, cheapest), len(cuts), plan[1], True)
        except DeadlineExceeded as err:
            stats["timed_out"] = True
            stats["reason"] = str(err)
        complete = len(allowed)
        slack = chain.slack_bytes  # 0 where the DP counts every step exactly
        if found:
            schedule, profile, used = min(found, key=lambda f: (f[1].recompute_s, -f[2]))
            proven = used == complete and not stats.get("timed_out")
        elif lowest:
            schedule, profile, used, counted, minimal = min(
                lowest, key=lambda f: (f[1].peak_bytes, -f[2], not f[4])
            )
            # No plan's count is below ``counted``, nor its simulated peak below that less
            # the slack.
            lower = counted - slack if used == complete and minimal else None
            stats["min_feasible_bytes"] = profile.peak_bytes
            stats["min_feasible_proven"] = lower == profile.peak_bytes
            stats["min_feasible_lower_bytes"] = lower
            proven = lower is not None and lower > budget_bytes  # no plan fits the budget
        else:
            schedule, used, proven = Schedule(), 0, False
            profile = simulate(graph, schedule)
        bound = profile.recompute_s if proven and found else None
        fits = profile.peak_bytes <= budget_bytes
        if slack and fits and used == complete and not stats.get("timed_out"):
            # A plan that fits as simulated fits the DP's count at ``slack`` bytes more:
            # the DP's optimum there bounds every plan of the space.
            try:
                wider = top_plan(dp_for(allowed, False), budget_bytes + slack)
            except DeadlineExceeded as err:
                wider = None
                stats.update(timed_out=True, reason=str(err))
            bound = wider[0] if wider is not None else None
            proven = bound is not None and profile.recompute_s <= bound * (1 + 1e-12)
            stats["bound_budget_bytes"] = budget_bytes + slack
        stats["cuts_used"] = used
        stats["frames_solved"] = sum(dp.frames_solved for dp in dps.values())
        over = space if used == complete else f"{space}, in {used} of the {complete} cuts"
        if chain.units == UNITS:
            # The space of blocks leaves keep-set schedules with other cuts out: what the
            # DP proves holds over it alone, so it is stated apart from the result's status.
            stats["space_proof"] = {
                "over": over,
                "optimal": proven and fits,
                "infeasible": proven and not fits,
                "bound_s": bound,
                "min_peak_lower_bytes": stats.get("min_feasible_lower_bytes"),
            }
            if "min_feasible_bytes" in stats:
                stats.update(min_feasible_proven=False, min_feasible_lower_bytes=None)
            bound, proven = None, False
        elif used:
            stats["optimal_over"] = over
        result = result_from_profile(
            schedule,
            profile,
            budget_bytes=budget_bytes,
            solver=self.name,
            solve_s=deadline.elapsed_s(),
            bound=bound,
            proven_optimal=proven and fits,
            proven_infeasible=proven and not fits,
            stats=stats,
        )
        if stats.get("timed_out") and not result.feasible:
            return dataclasses.replace(result, status=SolveStatus.TIMED_OUT)
        return result


def _judged(
    graph: CostGraph, chain: NestedChain, found: tuple[float, int, Plan]
) -> tuple[Schedule, MemoryProfile]:
    """Simulates the DP's plan and checks its prediction.

    Raises:
        SolverError: if the simulator and the DP disagree (a bug in dp_nested).
    """
    cost, peak, plan = found
    schedule = plan_schedule(graph, chain, plan)
    check_schedule(graph, schedule)
    profile = simulate(graph, schedule, check=False)
    # An exact model counts each step as the simulator does; a conservative one none
    # below it (its recompute time is exact either way).
    counted = peak if chain.exact or peak < profile.peak_bytes else profile.peak_bytes
    check_prediction(
        graph, profile, peak_bytes=counted, cost_s=cost, model="dp_nested", what=f"plan {plan}"
    )
    return schedule, profile
