"""Measured op times: run the captured graph for real and time every op's forward.

The tracer's default times come from a roofline model (FLOPs and bytes). When the model's
tensors are real (not on the meta device), :func:`measure_forward_times` runs the graph a
few times under ``torch.no_grad()`` and keeps each op's median forward time, which is what
recomputation costs. Module state (buffers, the RNG) is restored afterwards.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.fx


def measure_forward_times(
    module: torch.fx.GraphModule, flat_inputs: list[Any], *, repeats: int = 3
) -> dict[str, float]:
    """Median forward seconds of every call node, over ``repeats`` runs after a warm-up."""
    device = next(
        (x.device for x in flat_inputs if isinstance(x, torch.Tensor)), torch.device("cpu")
    )
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    samples: dict[str, list[float]] = {}

    class _Timer(torch.fx.Interpreter):
        def run_node(self, node: torch.fx.Node) -> Any:
            if node.op not in ("call_function", "call_method", "call_module"):
                return super().run_node(node)
            sync()
            start = time.perf_counter()
            out = super().run_node(node)
            sync()
            samples.setdefault(node.name, []).append(time.perf_counter() - start)
            return out

    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    rng = torch.random.get_rng_state()
    try:
        with torch.no_grad():
            for _ in range(repeats + 1):
                _Timer(module).run(*flat_inputs)
    finally:
        with torch.no_grad():
            for name, b in module.named_buffers():
                b.copy_(buffers[name])
        torch.random.set_rng_state(rng)
    return {name: statistics.median(values[1:] or values) for name, values in samples.items()}
