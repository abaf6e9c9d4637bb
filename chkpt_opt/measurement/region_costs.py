"""What recompute regions cost beyond their ops: measured, for the cost graph.

Every region is a non-reentrant checkpoint call: saved-tensor hooks around its forward, a
frame that replays it in the backward pass, codegen's guards around both. On a CPU that
is a few hundred microseconds per region, which the per-op times do not hold: a solver
that does not see it prefers many small regions to a few large ones that run faster (in
``benchmarks/hf_models.py`` at d0ba7d0, before this was measured, ViT at HF checkpointing's
peak ran at 1.43x against HF's 1.31x; docs/results.md has the run after it).

A region that caches ops runs under a selective-checkpoint policy: a Python dispatch mode
that sees every op of its forward and of its replay. That costs a setup per region and
microseconds per op (on the padded Llama of ``benchmarks/padded.py``, before it was
measured, a plan caching 37 ops in 4 regions ran at 1.063 of HF checkpointing's step time
where the keep-set plan it was predicted to beat ran at 0.998).

:func:`measure_region_costs` runs a small chain (one cheap op per layer) through codegen
under several schedules, interleaved, and charges the step-time differences, less the
replayed ops' own forward time, to what they differ in: regions (one per op against
none), and policies (the same regions caching one op each, in many small regions and in
two large ones, which separates the per-region setup from the per-op dispatch).
``trace(..., profile_times=True)`` (and so ``plan``) stores the results in the graph
(:func:`~chkpt_opt.measurement.driver.measure_traced`), where the simulator and the
solvers' models count them (:mod:`chkpt_opt.memory_model.region_replay`).
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from chkpt_opt.codegen.rewrite import rewrite_module
from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes
from chkpt_opt.graphs.tracer import trace_model
from chkpt_opt.measurement.op_times import measure_forward_times
from chkpt_opt.measurement.step import run_step
from chkpt_opt.memory_model.region_replay import policy_dispatches
from chkpt_opt.memory_model.schedule import Schedule, cacheable_ops, cut_positions
from chkpt_opt.memory_model.simulate import simulate

LAYERS = 16
"""Layers of the measured chain (one region each)."""

ROUNDS = 15
"""Interleaved rounds timed (after one warm-up)."""

LARGE_REGIONS = 2
"""Regions the chain is split into for the policy's per-op cost."""


@dataclass(frozen=True)
class RegionCosts:
    """What regions cost on a device beyond the ops they recompute, in seconds (each at
    least 0); the graph attributes of the same names.

    Attributes:
        region_overhead_s: every region (the checkpoint call and its replay's setup).
        cached_region_overhead_s: a region that caches ops, once (its policy's setup).
        cached_op_overhead_s: every op such a region's policy dispatches, forward or replay.
    """

    region_overhead_s: float
    cached_region_overhead_s: float
    cached_op_overhead_s: float

    def store(self, graph: CostGraph) -> None:
        """Writes the costs into ``graph``'s attributes."""
        graph.graph["region_overhead_s"] = self.region_overhead_s
        graph.graph["cached_region_overhead_s"] = self.cached_region_overhead_s
        graph.graph["cached_op_overhead_s"] = self.cached_op_overhead_s


class _Chain(nn.Module):
    """``LAYERS`` times ``x = tanh(x * w[i])`` on a small tensor, then a sum."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(LAYERS, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(LAYERS):
            x = torch.tanh(x * self.weight[i])
        return x.sum()


def _caching_one_op_each(graph: CostGraph, schedule: Schedule) -> Schedule:
    """``schedule`` with the first cacheable op of each region cached."""
    cacheable = cacheable_ops(graph)
    saved = frozenset(
        next(n for n in region if n in cacheable)
        for region in schedule.regions
        if any(n in cacheable for n in region)
    )
    return Schedule(schedule.regions, schedule.nested, saved)


def _schedules(graph: CostGraph) -> dict[str, Schedule]:
    """The measured schedules: none, a region per op, a region per layer, two regions; the
    last two also caching one op in each region."""
    cuts = [p for p, ok in enumerate(cut_positions(graph)) if ok]
    n = len(ordered_nodes(graph))
    per_layer = [p for p in cuts if p % (n // LAYERS) == 0]
    large = per_layer[:: LAYERS // LARGE_REGIONS]
    layers = Schedule.from_spans(graph, list(itertools.pairwise(per_layer)))
    two = Schedule.from_spans(graph, list(itertools.pairwise(large)))
    return {
        "plain": Schedule(),
        "split": Schedule.from_spans(graph, list(itertools.pairwise(cuts))),
        "layers": layers,
        "layers_cached": _caching_one_op_each(graph, layers),
        "two": two,
        "two_cached": _caching_one_op_each(graph, two),
    }


def measure_region_costs(device: torch.device | str = "cpu") -> RegionCosts:
    """What recompute regions and selective-checkpoint policies cost on ``device`` beyond
    the recomputation of their ops (see the module docstring)."""
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model = _Chain().to(device).train()
    # A generator of its own: measuring must not move the caller's random stream (the
    # drop-in path measures inside a training step, whose dropout must draw as before).
    gen = torch.Generator(device).manual_seed(0)
    args = (torch.randn(4, 16, device=device, generator=gen),)
    traced = trace_model(model, args, name="region-overhead")
    graph = traced.graph
    times = measure_forward_times(traced.captured.module, traced.captured.flat_inputs)
    for name, attrs in graph.nodes(data=True):
        attrs["fwd_time_s"] = times.get(name, attrs["fwd_time_s"])
    schedules = _schedules(graph)
    modules = {
        name: rewrite_module(traced.captured.fresh_module(), graph, schedule)
        for name, schedule in schedules.items()
    }
    samples: dict[str, list[float]] = {name: [] for name in modules}
    for round_ in range(ROUNDS + 1):
        for name, module in modules.items():
            model.weight.grad = None
            sync()
            start = time.perf_counter()
            run_step(module, args, {})
            sync()
            if round_:
                samples[name].append(time.perf_counter() - start)

    def unexplained_s(name: str, base: str) -> float:
        """Measured step time of ``name`` beyond ``base``'s, less the recompute time the
        simulator (without any overhead) predicts between them."""
        measured = statistics.median(samples[name]) - statistics.median(samples[base])
        predicted = (
            simulate(graph, schedules[name]).recompute_s
            - simulate(graph, schedules[base]).recompute_s
        )
        return measured - predicted

    region_s = max(0.0, unexplained_s("split", "plain") / len(schedules["split"].regions))
    # Per policy: many small regions and two large ones dispatch about as many ops, so
    # their difference is the per-region setup, and the rest is per op.
    small_s = unexplained_s("layers_cached", "layers")
    large_s = unexplained_s("two_cached", "two")
    small_ops = sum(policy_dispatches(graph, schedules["layers_cached"]))
    large_ops = sum(policy_dispatches(graph, schedules["two_cached"]))
    small_n = len(schedules["layers_cached"].regions)
    large_n = len(schedules["two_cached"].regions)
    ratio = small_ops / large_ops
    policy_region_s = max(0.0, (small_s - large_s * ratio) / (small_n - large_n * ratio))
    policy_op_s = max(0.0, (large_s - large_n * policy_region_s) / large_ops)
    return RegionCosts(region_s, policy_region_s, policy_op_s)
