"""Validation: does the optimized module compute the same thing, in the memory predicted?

:func:`validate` runs one step of the original model and one of the optimized module from
the same RNG state, compares outputs, parameter gradients and buffers (batch-norm
statistics), measures both peaks, and times both in the same run (interleaved, median of
several steps) to report a step-time ratio with its spread. The model is left as it was
found: buffers, gradients and RNG state are restored.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from chkpt_opt.graphs.tracer.capture import normalize_inputs
from chkpt_opt.measurement.module_state import preserved_state
from chkpt_opt.measurement.step import device_of, measure_step, time_step
from chkpt_opt.step_budget.budget import format_bytes


@dataclass(frozen=True)
class ValidationReport:
    """What :func:`validate` found.

    Peak bytes are those created during forward and backward, on top of the resident
    memory (parameters, inputs, optimizer state), as the simulator predicts them.

    Attributes:
        grads_bitwise_equal: every parameter gradient is bit-for-bit the original's.
        outputs_bitwise_equal: the outputs are bit-for-bit the original's.
        buffers_bitwise_equal: buffers (batch-norm statistics...) end the step identical.
        max_grad_rel_diff: largest ``max|g_opt - g_ref| / max|g_ref|`` over the parameters
            whose gradients differ (NaN where one gradient has NaN where the other has not).
        grads_missing: parameters that get a gradient in one step but not in the other
            (they make the gradients unequal whatever ``max_grad_rel_diff`` says).
        predicted_peak_bytes: the simulator's prediction for the optimized step, if known.
        measured_peak_bytes: the measured peak of the optimized step.
        baseline_peak_bytes: the measured peak of the original step.
        step_time_ratio: median over rounds of the optimized step's time over the
            original's, the two run back to back in alternating order every round.
        step_time_ratio_spread: half the interquartile range of those per-round ratios
            (the ratio's noise on this machine, in the same units).
        time_rounds: the rounds timed.
        device: where the steps ran.
    """

    grads_bitwise_equal: bool
    outputs_bitwise_equal: bool
    buffers_bitwise_equal: bool
    max_grad_rel_diff: float
    predicted_peak_bytes: int | None
    measured_peak_bytes: int
    baseline_peak_bytes: int
    step_time_ratio: float
    device: str
    step_time_ratio_spread: float = 0.0
    time_rounds: int = 0
    grads_missing: tuple[str, ...] = ()

    @property
    def prediction_error(self) -> float | None:
        """``(predicted - measured) / measured``; positive means the prediction is conservative."""
        if self.predicted_peak_bytes is None or self.measured_peak_bytes == 0:
            return None
        return (self.predicted_peak_bytes - self.measured_peak_bytes) / self.measured_peak_bytes

    def summary(self) -> str:
        """A few human-readable lines."""
        if self.grads_bitwise_equal:
            grads = "bitwise equal"
        elif self.grads_missing:
            grads = "differ: no gradient on one side for " + ", ".join(self.grads_missing[:3])
        else:
            grads = f"differ, max rel diff {self.max_grad_rel_diff:.2e}"
        predicted = ""
        if self.predicted_peak_bytes is not None:
            predicted = (
                f", predicted {format_bytes(self.predicted_peak_bytes)} "
                f"({self.prediction_error:+.2%})"
            )
        lines = [
            f"gradients: {grads}"
            f"; outputs {'equal' if self.outputs_bitwise_equal else 'differ'}"
            f"; buffers {'equal' if self.buffers_bitwise_equal else 'differ'}",
            f"peak (forward+backward, {self.device}): "
            f"measured {format_bytes(self.measured_peak_bytes)}{predicted}"
            f", without checkpointing {format_bytes(self.baseline_peak_bytes)}",
            f"step time vs original: {self.step_time_ratio:.2f}x"
            f" (spread ±{self.step_time_ratio_spread:.2f} over {self.time_rounds} rounds)",
        ]
        return "\n".join(lines)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {
        n: (p.grad.detach().clone() if p.grad is not None else None)
        for n, p in model.named_parameters()
    }


def _clear_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _equal(a: Any, b: Any) -> bool:
    la, lb = tree_flatten(a)[0], tree_flatten(b)[0]
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor) and not (x.shape == y.shape and torch.equal(x, y)):
            return False
    return True


def validate(
    model: torch.nn.Module,
    optimized: torch.nn.Module,
    example_inputs: Any,
    example_kwargs: dict[str, Any] | None = None,
    *,
    predicted_peak_bytes: int | None = None,
    repeats: int = 9,
    seed: int = 0,
) -> ValidationReport:
    """Compares one step of ``optimized`` against one step of ``model``.

    Args:
        model: the original model.
        optimized: the optimized module (sharing the model's parameters).
        example_inputs: positional inputs of the step.
        example_kwargs: keyword inputs of the step.
        predicted_peak_bytes: the simulator's forward+backward peak for ``optimized``
            (``plan.profile.peak_bytes``), reported beside the measured one.
        repeats: rounds timed for the time ratio (each runs both modules once, in
            alternating order, after one warm-up round).
        seed: RNG seed of the compared steps.
    """
    args, kwargs = normalize_inputs(example_inputs, example_kwargs)
    with preserved_state(model):
        start_buffers = {n: b.detach().clone() for n, b in model.named_buffers()}

        def one(
            module: torch.nn.Module,
        ) -> tuple[Any, dict[str, torch.Tensor | None], dict[str, torch.Tensor], int, str]:
            with torch.no_grad():
                for n, b in model.named_buffers():
                    b.copy_(start_buffers[n])
            _clear_grads(model)
            torch.manual_seed(seed)
            measured = measure_step(module, args, kwargs)
            buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
            return measured.outputs, _grads(model), buffers, measured.peak_bytes, measured.device

        if device_of(model, args).type == "cuda":
            # Libraries take their workspaces on first use (cuBLAS: one per thread and
            # stream, the backward's thread included) and keep them: memory of the
            # process, not of a step. A first step of each lets both be measured warm.
            one(model)
            one(optimized)
        ref_out, ref_grads, ref_buf, base_peak, device = one(model)
        opt_out, opt_grads, opt_buf, opt_peak, _ = one(optimized)

        bitwise, max_rel, missing = _compare_grads(ref_grads, opt_grads)
        buffers_equal = all(torch.equal(ref_buf[n], opt_buf[n]) for n in ref_buf)
        ratios = _time_ratios(model, optimized, args, kwargs, repeats)
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return ValidationReport(
        grads_bitwise_equal=bitwise,
        outputs_bitwise_equal=_equal(ref_out, opt_out),
        buffers_bitwise_equal=buffers_equal,
        max_grad_rel_diff=max_rel,
        predicted_peak_bytes=predicted_peak_bytes,
        measured_peak_bytes=opt_peak,
        baseline_peak_bytes=base_peak,
        step_time_ratio=statistics.median(ratios),
        device=device,
        step_time_ratio_spread=(quartiles[2] - quartiles[0]) / 2,
        time_rounds=len(ratios),
        grads_missing=missing,
    )


def _compare_grads(
    ref: dict[str, torch.Tensor | None], opt: dict[str, torch.Tensor | None]
) -> tuple[bool, float, tuple[str, ...]]:
    """Bitwise equality, the largest relative difference, and the parameters with a
    gradient on one side only."""
    bitwise = True
    max_rel = 0.0
    missing: list[str] = []
    for name, g in ref.items():
        h = opt.get(name)
        if g is None or h is None:
            if (g is None) != (h is None):
                bitwise = False
                missing.append(name)
            continue
        if torch.equal(g, h):
            continue
        bitwise = False
        diff = (g.double() - h.double()).abs()
        if bool(torch.isnan(diff).any()) and not bool(torch.equal(g.isnan(), h.isnan())):
            max_rel = math.nan
            continue
        scale = g.abs().nan_to_num().max().item() or 1.0
        rel = diff.nan_to_num().max().item() / scale
        if not math.isnan(max_rel):
            max_rel = max(max_rel, rel)
    return bitwise, max_rel, tuple(missing)


def _time_ratios(
    model: torch.nn.Module,
    optimized: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    repeats: int,
) -> list[float]:
    """Per-round step-time ratios optimized / original; the order alternates every round so
    that drift on a loaded machine (frequency, caches, a neighbour's load) cancels."""
    ratios: list[float] = []
    for i in range(max(1, repeats) + 1):
        pair = [("ref", model), ("opt", optimized)]
        elapsed: dict[str, float] = {}
        for key, module in pair if i % 2 == 0 else pair[::-1]:
            _clear_grads(model)
            elapsed[key] = time_step(module, args, kwargs)
        if i > 0:  # the first round warms up
            ratios.append(elapsed["opt"] / elapsed["ref"])
    return ratios
