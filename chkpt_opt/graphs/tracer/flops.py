"""FLOP counting and the roofline time model of the tracer.

FLOPs come from PyTorch's ``FlopCounterMode``, completed with formulas for the ops it
misses: the CPU flash-attention kernels that ``scaled_dot_product_attention`` dispatches to
on CPU. Pointwise and reduction ops, which the counter ignores, count one FLOP per output
element (their cost is memory traffic, which the time model covers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import flop_counter as fc

aten = torch.ops.aten


def _cpu_flash_fwd(
    query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    return fc.sdpa_flop_count(query, key, value)


def _cpu_flash_bwd(
    grad_out: Any,
    query: Any,
    key: Any,
    value: Any,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    return fc.sdpa_backward_flop_count(grad_out, query, key, value)


_EXTRA_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_fwd,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_bwd,
}


def flop_counter() -> fc.FlopCounterMode:
    """A silent FlopCounterMode that also counts CPU flash attention."""
    return fc.FlopCounterMode(display=False, custom_mapping=dict(_EXTRA_FORMULAS))


@dataclass(frozen=True)
class DeviceModel:
    """A roofline model of a device, used to estimate op times from FLOPs and bytes.

    Attributes:
        name: model name, recorded in the cost graph.
        flops_per_s: sustained floating-point throughput.
        bytes_per_s: sustained memory bandwidth.
        op_overhead_s: fixed cost of launching one op.
    """

    name: str
    flops_per_s: float
    bytes_per_s: float
    op_overhead_s: float

    def time_s(self, flops: int, io_bytes: int) -> float:
        """Estimated time of an op: the slower of compute and memory, plus launch overhead."""
        return max(flops / self.flops_per_s, io_bytes / self.bytes_per_s) + self.op_overhead_s


DEVICE_MODELS: dict[str, DeviceModel] = {
    "cpu": DeviceModel("roofline-cpu", flops_per_s=5e10, bytes_per_s=1e10, op_overhead_s=5e-6),
    "cuda": DeviceModel("roofline-cuda", flops_per_s=4e14, bytes_per_s=3e12, op_overhead_s=5e-6),
    "meta": DeviceModel("roofline-cuda", flops_per_s=4e14, bytes_per_s=3e12, op_overhead_s=5e-6),
}


def device_model(device_type: str) -> DeviceModel:
    """The roofline model for a device type (``"cpu"``, ``"cuda"``; ``"meta"`` plans for CUDA)."""
    return DEVICE_MODELS.get(device_type, DEVICE_MODELS["cuda"])
