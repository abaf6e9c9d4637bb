"""The capture rules ``plan``, ``trace`` and the attachment share: when op times are
measured by default, and the calls a rewritten capture takes (the ``use_cache`` rule is
tested on peft in ``test_peft.py``)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist

from chkpt_opt.attachment.call_inputs import measures_times, positional, with_call_defaults
from chkpt_opt.graphs.costgraph import new_graph


def test_op_times_are_measured_where_tensors_are_real_outside_a_process_group(
    tmp_path: Path,
) -> None:
    cpu, meta = new_graph("cpu"), new_graph("meta")
    cpu.graph["device_type"], meta.graph["device_type"] = "cpu", "meta"
    assert measures_times(None, cpu) and not measures_times(None, meta)
    assert measures_times(True, meta) and not measures_times(False, cpu)  # as asked
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:  # every rank must plan the same schedule: the estimate, unless asked
        assert not measures_times(None, cpu) and measures_times(True, cpu)
    finally:
        dist.destroy_process_group()


def test_positional_inputs() -> None:
    x = torch.ones(2)
    assert positional(x) == (x,) and positional([x, x]) == (x, x) and positional(None) == ()


class _Cached(torch.nn.Module):
    def forward(self, x: torch.Tensor, *, use_cache: bool = True) -> torch.Tensor:
        assert use_cache is False, "the capture was made with use_cache=False"
        return x * 2


def test_a_rewritten_capture_fills_in_the_keywords_a_call_leaves_out() -> None:
    x = torch.ones(2)
    module = with_call_defaults(_Cached(), {"x": x, "use_cache": False})
    assert torch.equal(module(x=x), x * 2)  # use_cache filled in; tensors never are
    assert torch.equal(copy.deepcopy(module)(x=x), x * 2)
    assert torch.equal(module(x=x, use_cache=False), x * 2)
    assert not with_call_defaults(_Cached(), {"x": x})._forward_pre_hooks  # nothing to fill
