"""What recompute regions cost beyond their ops' forward time: measured, for the cost graph.

Every region is a non-reentrant checkpoint call: a frame that replays it in the backward
pass and codegen's guards around both, paid once per region, and saved-tensor hooks that
pack every tensor an op inside it saves (in the forward pass and again in the replay) and
unpack it in the backward, paid per saved tensor. On a CPU the first is about a hundred
microseconds and the second about ten per tensor, which the per-op times do not hold: a
solver that does not see them prefers many small regions to a few large ones that run
faster (in ``benchmarks/hf_models.py`` at d0ba7d0, before this module, ViT at HF
checkpointing's peak ran at 1.43x against HF's 1.31x). Where small kernels leave the CPU the
bottleneck (a GPU running a small model) the hooks dominate: the zoo GPT's plan on an H200
cost 8.1 ms a step beyond the original's where the per-region charge alone predicted 4.4
(``benchmarks/results/cuda/cuda_phases.txt``).

:func:`measure_checkpoint_overheads` runs a small chain (cheap ops on a small tensor)
through codegen without regions, with a region per allowed span, and with one region over
all of them, interleaved, and solves the two step-time differences (less the replayed ops'
own forward time) for the cost per region and per tensor saved by a replayed op.
``plan(..., profile_times=True)`` stores them in the graph (``region_overhead_s`` and
``saved_tensor_overhead_s``), where the simulator and the solvers' models count them: per
region, and per tensor saved by each recompute step
(:func:`~chkpt_opt.graphs.costgraph.recompute_time_s`).
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from chkpt_opt.codegen.rewrite import apply_schedule
from chkpt_opt.graphs.tracer import trace_model
from chkpt_opt.graphs.tracer.timing import measure_forward_times
from chkpt_opt.measure import run_step
from chkpt_opt.op_sequence import lower
from chkpt_opt.schedule import Schedule, cut_positions
from chkpt_opt.simulate import simulate

LAYERS = 16
"""Layers of the measured chain."""

ROUNDS = 31
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


@dataclass(frozen=True)
class CheckpointOverheads:
    """Seconds a recompute region costs beyond its ops' forward time.

    Attributes:
        region_s: per region (the graph's ``region_overhead_s``).
        saved_tensor_s: per tensor that a replayed op saves (``saved_tensor_overhead_s``).
    """

    region_s: float
    saved_tensor_s: float


def measure_checkpoint_overheads(device: torch.device | str = "cpu") -> CheckpointOverheads:
    """The costs of regions on ``device`` (see the module docstring); each at least 0."""
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model = _Chain().to(device).train()
    args = (torch.randn(4, 16, device=device),)
    traced = trace_model(model, args, name="region-overhead")
    graph = traced.graph
    times = measure_forward_times(traced.captured.module, traced.captured.flat_inputs)
    for name, attrs in graph.nodes(data=True):
        attrs["fwd_time_s"] = times.get(name, attrs["fwd_time_s"])
    cuts = [p for p, ok in enumerate(cut_positions(graph)) if ok]
    schedules = {
        "split": Schedule.from_spans(graph, list(itertools.pairwise(cuts))),
        "whole": Schedule.from_spans(graph, [(cuts[0], cuts[-1])]),
    }
    modules = {
        name: apply_schedule(traced.captured.fresh_module(), graph, schedule)
        for name, schedule in {"plain": Schedule(), **schedules}.items()
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
    plain_s = statistics.median(samples["plain"])
    # Per schedule: (regions, tensors saved by its recompute steps, time beyond the replay).
    rows = []
    for name, schedule in schedules.items():
        replayed = [s.node for s in lower(graph, schedule) if s.kind == "recompute"]
        extra_s = statistics.median(samples[name]) - plain_s - simulate(graph, schedule).recompute_s
        saved = sum(graph.nodes[v]["n_saved"] for v in replayed)
        rows.append((len(schedule.regions), saved, extra_s))
    (n1, s1, e1), (n2, s2, e2) = rows
    det = n1 * s2 - n2 * s1
    if det == 0:  # (never on the chain above: one region against one per span)
        return CheckpointOverheads(max(0.0, e1 / max(n1, 1)), 0.0)
    region_s = (e1 * s2 - e2 * s1) / det
    saved_s = (n1 * e2 - n2 * e1) / det
    if saved_s < 0:  # noise: all of it per region
        return CheckpointOverheads(max(0.0, e1 / n1), 0.0)
    if region_s < 0:
        return CheckpointOverheads(0.0, max(0.0, e2 / max(s2, 1)))
    return CheckpointOverheads(region_s, saved_s)
