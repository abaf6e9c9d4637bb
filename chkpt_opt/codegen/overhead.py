"""What one recompute region costs beyond its ops: measured, for the cost graph.

Every region is a non-reentrant checkpoint call: saved-tensor hooks around its forward, a
frame that replays it in the backward pass, codegen's guards around both. On a CPU that
is a few hundred microseconds per region, which the per-op times do not hold: a solver
that does not see it prefers many small regions to a few large ones that run faster (in
``benchmarks/hf_models.py`` at d0ba7d0, before this module, ViT at HF checkpointing's
peak ran at 1.43x against HF's 1.31x; docs/results.md has the run after it).

:func:`measure_region_overhead_s` runs a small chain (one cheap op per layer) through
codegen twice, without regions and with a region per layer, interleaved, and charges the
step-time difference, less the replayed ops' own forward time, to the regions. ``plan(...,
profile_times=True)`` stores it in the graph (``region_overhead_s``), where the simulator
and the solvers' models count it for every region.
"""

from __future__ import annotations

import itertools
import statistics
import time

import torch
from torch import nn

from chkpt_opt.codegen.rewrite import apply_schedule
from chkpt_opt.graphs.tracer import trace_model
from chkpt_opt.graphs.tracer.timing import measure_forward_times
from chkpt_opt.measure import run_step
from chkpt_opt.schedule import Schedule, cut_positions
from chkpt_opt.simulate import simulate

LAYERS = 16
"""Layers of the measured chain (one region each)."""

ROUNDS = 15
"""Interleaved rounds timed (after one warm-up)."""


class _Chain(nn.Module):
    """``LAYERS`` times ``x = tanh(x * w[i])`` on a small tensor, then a sum."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(LAYERS, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(LAYERS):
            x = torch.tanh(x * self.weight[i])
        return x.sum()


def measure_region_overhead_s(device: torch.device | str = "cpu") -> float:
    """Seconds one recompute region adds to a training step on ``device`` beyond the
    recomputation of its ops (see the module docstring); at least 0."""
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
    cuts = [p for p, ok in enumerate(cut_positions(graph)) if ok]
    split = Schedule.from_spans(graph, list(itertools.pairwise(cuts)))
    if not split.regions:
        return 0.0
    replayed_s = simulate(graph, split).recompute_s
    modules = {
        "plain": apply_schedule(traced.captured.fresh_module(), graph, Schedule()),
        "split": apply_schedule(traced.captured.fresh_module(), graph, split),
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
    extra = statistics.median(samples["split"]) - statistics.median(samples["plain"])
    return max(0.0, (extra - replayed_s) / len(split.regions))
