"""The plan a Hugging Face user gets meets the model's own checkpointing: at the peak
``gradient_checkpointing_enable()`` measures, chkpt_opt's plan measures no more and
recomputes no more than per-layer checkpointing (the same cost model, on the same graph).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

pytest.importorskip("transformers")

from chkpt_opt.api import plan
from chkpt_opt.graphs.costgraph import ordered_nodes
from chkpt_opt.measurement.step import measure_step_allocator
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.zoo import huggingface


def allocator_peak(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> int:
    for p in module.parameters():
        p.grad = None
    return measure_step_allocator(module, args)


def test_a_llama_plan_at_hf_checkpointings_peak_fits_and_recomputes_no_more() -> None:
    model, args, _ = huggingface.llama(layers=4, width=64, batch=2, seq=128)
    hf = copy.deepcopy(model)
    hf.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_peak = allocator_peak(hf, args)
    base = plan(model, args, budget=10**15, optimizer=None, solver="keep_all")
    assert hf_peak < base.profile.peak_bytes  # checkpointing does save memory here
    made = plan(
        model,
        args,
        budget=base.static.resident_bytes + hf_peak,
        optimizer=None,
        time_limit_s=20,
    )
    assert allocator_peak(made.apply(), args) <= hf_peak
    graph = made.graph
    spans: dict[int, list[int]] = {}
    for i, node in enumerate(ordered_nodes(graph)):
        found = re.search(r"\blayers\.(\d+)\.", graph.nodes[node]["module_path"] + ".")
        if found:
            spans.setdefault(int(found.group(1)), [i, i + 1])[1] = i + 1
    per_layer = simulate(graph, Schedule.from_spans(graph, [tuple(s) for s in spans.values()]))
    assert len(spans) == 4
    assert made.profile.recompute_s <= per_layer.recompute_s * (1 + 1e-9)
