"""Captures with symbolic sizes: which shapes one graph serves, and whether it computes
what the capture at fixed shapes computes."""

from __future__ import annotations

import torch
from torch import nn

from chkpt_opt.graphs.tracer import trace_model
from chkpt_opt.graphs.tracer.dynamic_dims import InputDims, program_ops


def test_a_graph_admits_shapes_no_larger_than_its_example() -> None:
    dims = InputDims(
        dims={"input_ids": ("s0", "s1"), "mask": ("s0", "s1"), "table": (8,)},
        ranges={"s0": (2, None), "s1": (2, 512)},
        example={"s0": 4, "s1": 256},
    )
    same = {"input_ids": (4, 256), "mask": (4, 256), "table": (8,)}
    assert dims.admits(same)
    assert dims.admits({"input_ids": (2, 100), "mask": (2, 100), "table": (8,)})
    assert not dims.admits({"input_ids": (5, 100), "mask": (5, 100), "table": (8,)})  # larger
    assert not dims.admits({"input_ids": (1, 100), "mask": (1, 100), "table": (8,)})  # range
    assert not dims.admits({"input_ids": (2, 100), "mask": (3, 100), "table": (8,)})  # s0 twice
    assert not dims.admits({"input_ids": (2, 100), "mask": (2, 100), "table": (9,)})  # static
    assert not dims.admits({"input_ids": (2, 100), "mask": (2, 100)})  # another input set


class _Pinned(nn.Module):
    """Its width is pinned by a weight, its batch and length are free."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x)).sum()


def test_a_symbolic_capture_keeps_free_sizes_symbolic_and_computes_the_same() -> None:
    model = _Pinned()
    x = torch.randn(4, 10, 16)
    symbolic = trace_model(model, (x,), method="export", dynamic=True)
    dims = symbolic.captured.input_dims
    assert dims is not None and dims.symbolic
    batch, length, width = dims.dims["args[0]"]
    assert isinstance(batch, str) and isinstance(length, str) and width == 16
    assert dims.admits({"args[0]": (3, 7, 16)}) and not dims.admits({"args[0]": (3, 11, 16)})
    fixed = trace_model(model, (x,))
    assert program_ops(symbolic.captured.module) == program_ops(fixed.captured.module)
    smaller = torch.randn(3, 7, 16)
    assert torch.equal(symbolic.captured.fresh_module()(smaller), model(smaller))
