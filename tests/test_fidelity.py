"""The captured program is the model's own: a rewrite with no recompute region measures
the same peak as the original model, on Hugging Face families built from configs.

Small configs (2 layers, width 64, batch 2 x 64 tokens) keep this in the default suite;
``benchmarks/hf_models.py`` measures the same at the benchmark's size.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from chkpt_opt.api import plan
from chkpt_opt.graphs.tracer.capture import capture
from chkpt_opt.measurement.step import measure_step
from chkpt_opt.zoo import huggingface as hf_zoo

SMALL = {"layers": 2, "width": 64, "batch": 2, "seq": 64}
FIDELITY = 0.005  # the keep-all rewrite within 0.5% of the original's peak


def measured_peak(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> int:
    for p in module.parameters():
        p.grad = None
    torch.manual_seed(0)
    return measure_step(module, args).peak_bytes


@pytest.mark.parametrize("family", sorted(hf_zoo.FAMILIES))
def test_keep_all_rewrite_costs_what_the_original_costs(family: str) -> None:
    model, args, _ = hf_zoo.FAMILIES[family](**SMALL)
    original = measured_peak(model, args)
    made = plan(model, args, budget=10**12, optimizer=None, solver="keep_all")
    rewritten = measured_peak(made.apply(), args)
    assert abs(rewritten - original) <= FIDELITY * original, (family, original, rewritten)
    predicted = made.profile.peak_bytes
    assert abs(predicted - rewritten) <= 0.03 * rewritten, (family, predicted, rewritten)


def is_causal(node: torch.fx.Node) -> bool:
    """The ``is_causal`` argument of an SDPA node (positional or keyword)."""
    if len(node.args) > 5:
        return bool(node.args[5])
    return bool(node.kwargs.get("is_causal"))


def test_decoder_masks_are_captured_as_eager_runs_them() -> None:
    """Eagerly, HF's Llama passes is_causal=True to SDPA (no mask, grouped keys and values
    not repeated); the export branch materializes the mask and repeats them."""
    model, args, _ = hf_zoo.llama(**SMALL)
    captured = capture(model, args, {})
    sdpa = [
        n
        for n in captured.module.graph.nodes
        if n.op == "call_function" and "scaled_dot_product_attention" in str(n.target)
    ]
    assert sdpa and all(is_causal(n) for n in sdpa)
    assert all(n.kwargs.get("enable_gqa") for n in sdpa)
    assert any("no packed sequences" in note for note in captured.notes)


def test_a_position_input_keeps_the_general_program() -> None:
    """Position ids passed by the caller can be packed in another batch: the mask stays."""

    class WithPositions(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(
            self, ids: torch.Tensor, labels: torch.Tensor, pos: torch.Tensor
        ) -> torch.Tensor:
            return self.inner.hf(
                input_ids=ids, labels=labels, position_ids=pos, use_cache=False
            ).loss

    model, (ids, labels), _ = hf_zoo.llama(**SMALL)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    captured = capture(WithPositions(model).train(), (ids, labels, pos), {})
    sdpa = [
        n for n in captured.module.graph.nodes if "scaled_dot_product_attention" in str(n.target)
    ]
    assert sdpa and not any(is_causal(n) for n in sdpa)
    assert not any("no packed sequences" in note for note in captured.notes)
