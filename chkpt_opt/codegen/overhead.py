"""What recompute regions cost beyond their ops' forward time: measured, for the cost graph.

Every region is a non-reentrant checkpoint call: a frame that replays it in the backward
pass and codegen's guards around both, paid once per region, and saved-tensor hooks that
pack every tensor an op inside it saves (in the forward pass and again in the replay) and
unpack it in the backward, paid per saved tensor. The per-op times hold neither: a solver
that does not see them prefers many small regions to a few large ones that run faster (in
``benchmarks/hf_models.py`` at d0ba7d0, before regions were charged, ViT at HF
checkpointing's peak ran at 1.43x against HF's 1.31x).

Both costs are measured on the model's own ops (:func:`measure_model_overheads`): its
keep-all rewrite, and its rewrites with a region over every 1, 2 and 4 consecutive spans
between the places a region may begin or end, timed in interleaved rounds. Each
rewrite's step time beyond the keep-all one's, less its replayed ops' measured forward
times, is fitted (least squares, both costs at least 0) as ``regions * region_s +
replayed_saved_tensors * saved_tensor_s``. On launch-bound models on a GPU this is most
of a plan's extra time: on an H200, one cost per region measured on one-op regions (0.38
ms) charged the zoo GPT's rewrite with a region over every 8 spans 16.5 ms where it cost
33.1 beyond keep-all, while the two costs fitted on the models' own rewrites hold from
fine regions to coarse ones (``benchmarks/results/cuda/README.md``).

Where the model cannot be measured so (fewer than four spans, too little memory for its
keep-all step, too slow a step for the time given, or costs below its step-time noise),
:func:`measure_chain_overheads` measures one cost per region on a chain of one-op regions
instead, as ``plan`` did before the model fit: on the H200 the plans it made were as fast
as the model fit's, while a per-tensor cost fitted on that chain made the GPT's slower
(1.82x the original's step time against 1.64x, ``benchmarks/results/cuda/cuda_times.md``).
``plan(..., profile_times=True)`` stores the result in the graph (``region_overhead_s``
and ``saved_tensor_overhead_s``), where the simulator and the solvers' models count it:
per region, and per tensor saved by each recompute step
(:func:`~chkpt_opt.graphs.costgraph.recompute_time_s`).
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from chkpt_opt.codegen.rewrite import apply_schedule
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.tracer import Traced, trace_model
from chkpt_opt.graphs.tracer.module_state import preserved_state
from chkpt_opt.graphs.tracer.timing import measure_forward_times
from chkpt_opt.measure import device_of, run_step
from chkpt_opt.op_sequence import lower
from chkpt_opt.schedule import Schedule, cut_positions
from chkpt_opt.simulate import simulate

log = logging.getLogger(__name__)

LAYERS = 16
"""Layers of the fallback chain."""

CHAIN_ROUNDS = 15
"""Interleaved rounds timed on the fallback chain (after one warm-up)."""

MODEL_ROUNDS = 9
"""Interleaved rounds timed on the model (after one warm-up), time permitting."""

MIN_MODEL_ROUNDS = 3
"""Fewest rounds a model measurement is fitted on; with less time, the chain is measured."""

GROUPINGS = (1, 2, 4)
"""Regions over every k consecutive spans, for the model measurement."""


@dataclass(frozen=True)
class CheckpointOverheads:
    """Seconds a recompute region costs beyond its ops' forward time.

    Attributes:
        region_s: per region (the graph's ``region_overhead_s``).
        saved_tensor_s: per tensor that a replayed op saves (``saved_tensor_overhead_s``).
        measured_on: ``"model"`` (its own rewrites) or ``"chain"`` (the fallback chain).
    """

    region_s: float
    saved_tensor_s: float
    measured_on: str = "model"


def measure_overheads(traced: Traced, *, time_limit_s: float | None = None) -> CheckpointOverheads:
    """The costs of regions for ``traced`` (op times measured): on the model's own
    rewrites where it can be, on the fallback chain otherwise (see the module docstring)."""
    measured = measure_model_overheads(traced, time_limit_s=time_limit_s)
    if measured is None:
        measured = measure_chain_overheads(device_of(traced.captured.module, traced.args))
    log.info(
        "region overheads (measured on the %s): %.3f ms a region, %.1f us a saved tensor",
        measured.measured_on,
        measured.region_s * 1e3,
        measured.saved_tensor_s * 1e6,
    )
    return measured


def measure_model_overheads(
    traced: Traced, *, rounds: int = MODEL_ROUNDS, time_limit_s: float | None = None
) -> CheckpointOverheads | None:
    """The costs of regions fitted on the model's own rewrites, or None where it cannot
    be measured so: fewer than four spans, out of device memory, or fewer than
    :data:`MIN_MODEL_ROUNDS` rounds within ``time_limit_s``. The model's buffers,
    gradients and RNG states are as they were on return."""
    graph = traced.graph
    cuts = [p for p, ok in enumerate(cut_positions(graph)) if ok]
    if len(cuts) < 5:
        return None
    schedules = {f"every {k}": _grouped(graph, cuts, k) for k in GROUPINGS if len(cuts) > 2 * k}
    module = traced.captured.module
    device = device_of(module, traced.args)
    try:
        with preserved_state(module):
            samples = _time_rewrites(
                traced,
                {"plain": Schedule(), **schedules},
                rounds=rounds,
                min_rounds=MIN_MODEL_ROUNDS,
                time_limit_s=time_limit_s,
            )
    except torch.OutOfMemoryError:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        log.warning("region overheads: the keep-all step does not fit; measuring a chain")
        return None
    if samples is None:
        log.info("region overheads: the model's steps are too slow; measuring a chain")
        return None
    rows = _rows(graph, schedules, samples)
    fitted = _fit(rows, measured_on="model")
    plain = samples["plain"]
    noise_s = 2 * statistics.median(abs(x - statistics.median(plain)) for x in plain)
    finest_regions, finest_saved, _ = rows[0]
    finest_s = finest_regions * fitted.region_s + finest_saved * fitted.saved_tensor_s
    if finest_s <= noise_s:
        log.info("region overheads: below the model's step-time noise; measuring a chain")
        return None
    return fitted


def measure_chain_overheads(device: torch.device | str = "cpu") -> CheckpointOverheads:
    """One cost per region on ``device``, from a chain of cheap ops with a region per op
    against none (at least 0), and none per saved tensor: fitted on such a chain, the
    per-tensor cost falls short of a model's on a GPU, and the plans it made there ran
    slower than with the per-region cost alone (``benchmarks/results/cuda/cuda_times.md``)."""
    device = torch.device(device)
    model = _CheapChain().to(device).train()
    args = (torch.randn(4, 16, device=device),)
    traced = trace_model(model, args, name="region-overhead")
    graph = traced.graph
    times = measure_forward_times(traced.captured.module, traced.captured.flat_inputs)
    for name, attrs in graph.nodes(data=True):
        attrs["fwd_time_s"] = times.get(name, attrs["fwd_time_s"])
    cuts = [p for p, ok in enumerate(cut_positions(graph)) if ok]
    split = {"split": Schedule.from_spans(graph, list(itertools.pairwise(cuts)))}
    samples = _time_rewrites(traced, {"plain": Schedule(), **split}, rounds=CHAIN_ROUNDS)
    assert samples is not None  # no time limit
    [(regions, _, extra_s)] = _rows(graph, split, samples)
    return CheckpointOverheads(max(0.0, extra_s / regions), 0.0, "chain")


class _CheapChain(nn.Module):
    """``LAYERS`` times ``x = tanh(x * w[i])`` on a small tensor, then a sum."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(LAYERS, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(LAYERS):
            x = torch.tanh(x * self.weight[i])
        return x.sum()


def _grouped(graph: CostGraph, cuts: list[int], k: int) -> Schedule:
    """A region over every ``k`` consecutive spans between ``cuts`` (the last one shorter)."""
    ends = cuts[::k] if (len(cuts) - 1) % k == 0 else [*cuts[::k], cuts[-1]]
    return Schedule.from_spans(graph, list(itertools.pairwise(ends)))


def _time_rewrites(
    traced: Traced,
    schedules: Mapping[str, Schedule],
    *,
    rounds: int,
    min_rounds: int = 1,
    time_limit_s: float | None = None,
) -> dict[str, list[float]] | None:
    """Step seconds of every schedule's rewrite, in interleaved rounds after one warm-up:
    ``rounds`` of them, or as many as fit ``time_limit_s`` (None when fewer than
    ``min_rounds`` fit)."""
    start = time.perf_counter()
    args, kwargs = traced.args, traced.kwargs
    device = device_of(traced.captured.module, args)
    sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    modules = {
        name: apply_schedule(traced.captured.fresh_module(), traced.graph, schedule)
        for name, schedule in schedules.items()
    }
    params = list(traced.captured.module.parameters())
    samples: dict[str, list[float]] = {name: [] for name in modules}
    for round_ in range(rounds + 1):
        round_start = time.perf_counter()
        for name, module in modules.items():
            for p in params:
                p.grad = None
            sync()
            step_start = time.perf_counter()
            run_step(module, args, kwargs)
            sync()
            if round_:
                samples[name].append(time.perf_counter() - step_start)
        if time_limit_s is not None:
            now = time.perf_counter()
            left_rounds = (start + time_limit_s - now) / max(now - round_start, 1e-9)
            if round_ + left_rounds < min_rounds:
                return None
            if left_rounds < 1:
                break
    for p in params:
        p.grad = None
    return samples


def _rows(
    graph: CostGraph, schedules: Mapping[str, Schedule], samples: Mapping[str, list[float]]
) -> list[tuple[float, float, float]]:
    """Per schedule: its regions, the tensors its recompute steps save, and its median step
    seconds beyond the plain one's less its replayed ops' forward times."""
    plain_s = statistics.median(samples["plain"])
    rows = []
    for name, schedule in schedules.items():
        replayed = [s.node for s in lower(graph, schedule) if s.kind == "recompute"]
        extra_s = statistics.median(samples[name]) - plain_s - simulate(graph, schedule).recompute_s
        saved = sum(graph.nodes[v]["n_saved"] for v in replayed)
        rows.append((float(len(schedule.regions)), float(saved), extra_s))
    return rows


def _fit(rows: list[tuple[float, float, float]], *, measured_on: str) -> CheckpointOverheads:
    """Least squares over ``rows`` (see :func:`_rows`), both costs at least 0:
    ``extra_s = regions * region_s + saved_tensors * saved_tensor_s``."""
    rr = sum(r * r for r, _, _ in rows)
    ss = sum(s * s for _, s, _ in rows)
    rs = sum(r * s for r, s, _ in rows)
    ry = sum(r * y for r, _, y in rows)
    sy = sum(s * y for _, s, y in rows)
    det = rr * ss - rs * rs
    if det > 1e-9 * rr * ss:
        region_s = (ry * ss - sy * rs) / det
        saved_s = (sy * rr - ry * rs) / det
        if region_s >= 0 and saved_s >= 0:
            return CheckpointOverheads(region_s, saved_s, measured_on)
    # One of them at 0: the better of the two one-cost fits.
    only_region = max(0.0, ry / rr) if rr else 0.0
    only_saved = max(0.0, sy / ss) if ss else 0.0

    def residual(region_s: float, saved_s: float) -> float:
        return sum((y - r * region_s - s * saved_s) ** 2 for r, s, y in rows)

    if residual(only_region, 0.0) <= residual(0.0, only_saved):
        return CheckpointOverheads(only_region, 0.0, measured_on)
    return CheckpointOverheads(0.0, only_saved, measured_on)
