"""Runs one training step (forward + backward) and measures its peak memory and time.

The step is the one the simulator models: call the module, then run the backward pass of
every floating-point output that requires grad, seeded with ones (for a model that returns
a scalar loss this is exactly ``loss.backward()``), or of the ``loss`` alone where the
output is a mapping that carries one (a Hugging Face model called with ``labels``: its
logits get no gradient, and are held, as the outputs are, until the backward returns).

Peak memory is the peak of bytes created during the step, on top of what was resident
before it (parameters, inputs, optimizer state): on CPU every tensor storage is tracked
exactly (:class:`~chkpt_opt.graphs.tracer.storage.StorageTracker`); on CUDA it is
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from chkpt_opt.graphs.tracer.step_outputs import grad_outputs as step_grad_outputs
from chkpt_opt.graphs.tracer.storage import StorageTracker


@dataclass(frozen=True)
class StepMeasurement:
    """One measured step.

    Attributes:
        peak_bytes: peak bytes created during forward and backward.
        outputs: the module's outputs, detached.
        device: ``"cpu"`` or ``"cuda"``.
    """

    peak_bytes: int
    outputs: Any
    device: str


def grad_outputs(out: Any) -> list[torch.Tensor]:
    """The outputs a step differentiates: a model's ``loss`` where its output carries one
    (a Hugging Face ``ModelOutput``), every floating-point tensor that requires grad
    otherwise (:mod:`chkpt_opt.graphs.tracer.step_outputs`, the rule the tracer follows)."""
    return step_grad_outputs(out)


def run_step(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Forward and backward once; returns the outputs (detached)."""
    out = module(*args, **kwargs)
    outs = grad_outputs(out)
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    return _detach(out)


def _detach(out: Any) -> Any:
    leaves, spec = tree_flatten(out)
    return spec.unflatten([x.detach() if isinstance(x, torch.Tensor) else x for x in leaves])


def device_of(module: torch.nn.Module, args: tuple[Any, ...]) -> torch.device:
    """The device a step runs on (of the first parameter or tensor input)."""
    for p in module.parameters():
        return p.device
    for x in tree_flatten(args)[0]:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def measure_step(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
) -> StepMeasurement:
    """Runs one step and measures its peak memory exactly (CPU) or by the allocator (CUDA)."""
    kwargs = kwargs or {}
    device = device_of(module, args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = run_step(module, args, kwargs)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        return StepMeasurement(peak_bytes=int(peak), outputs=out, device="cuda")
    with StorageTracker() as tracker:
        out = run_step(module, args, kwargs)
    return StepMeasurement(peak_bytes=tracker.peak_bytes, outputs=out, device=device.type)


def time_step(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    """Wall-clock seconds of one step (synchronized on CUDA)."""
    device = device_of(module, args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    run_step(module, args, kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


class _TimelineTracker(StorageTracker):
    def __init__(self) -> None:
        super().__init__()
        self.timeline: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.timeline.append(self.peak_bytes)
        self.reset_peak()
        return out


def measure_timeline(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
) -> list[int]:
    """Peak live bytes during each ATen op of one step, in order (CPU, exact)."""
    with _TimelineTracker() as tracker:
        run_step(module, args, kwargs or {})
    return tracker.timeline


def measure_step_allocator(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
) -> int:
    """Peak bytes allocated during one step, from the profiler's allocation events (CPU).

    Unlike :func:`measure_step`, this sees every allocation of the CPU allocator, also those
    a kernel makes and frees internally and those of code compiled by ``torch.compile``;
    use it to compare eager and compiled strategies on the same ruler.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_step(module, args, kwargs or {})
    events: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            events.append((event.start_time_ns, event.extra_fields.alloc_size))
        stack.extend(event.children)
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak
