"""The capture rules ``plan``, ``trace`` and the attachment share: when op times are
measured by default (the ``use_cache`` rule is tested on peft in ``test_peft.py``)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from chkpt_opt.attachment.call_inputs import measures_times, positional
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
