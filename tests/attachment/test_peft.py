"""A LoRA model (``peft.get_peft_model``) and other wrappers whose forward takes
``**kwargs``, served as their base model: the ``use_cache=False`` of a training call
reaches through the wrapper, one capture with symbolic sizes serves every smaller batch,
one solve."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import chkpt_opt
from chkpt_opt.attachment.call_inputs import takes_use_cache, training_kwargs
from chkpt_opt.graphs.tracer.storage import StorageTracker
from tests.attachment.tiny_models import tiny_llama

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

VOCAB = 512


def _lora() -> Any:
    """A 2-layer Llama from its config as it ships (``use_cache=True``) under LoRA r=8 on
    q and v, with random LoRA weights (both factors, so every LoRA gradient is nonzero)."""
    base = tiny_llama(vocab=VOCAB, layers=2)
    config = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    return peft.get_peft_model(base, config).train()


def _batch(batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    """A tokenizer's batch: ids, an all-ones attention mask, labels."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    labels = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[dict[str, Any], int]:
    """``outputs = model(**batch); outputs.loss.backward()``: the LoRA parameters'
    gradients and the step's exact peak of bytes created (CPU storage tracker)."""
    for p in model.parameters():
        p.grad = None
    with StorageTracker() as tracker:
        outputs = model(**batch)
        outputs.loss.backward()
        del outputs
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return grads, tracker.peak_bytes


def test_the_use_cache_default_reaches_through_the_wrapper() -> None:
    model = _lora()
    assert takes_use_cache(model)
    assert training_kwargs(model, {"input_ids": 1}) == {"input_ids": 1, "use_cache": False}
    assert training_kwargs(model, {"use_cache": True}) == {"use_cache": True}  # said: kept

    class Passes(torch.nn.Module):  # a wrapper that forwards **kwargs to a model
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, **kwargs: Any) -> Any:
            return self.model(**kwargs)

    assert takes_use_cache(Passes(model))
    assert not takes_use_cache(Passes(torch.nn.Linear(2, 2)))  # wraps none that takes it


def test_a_lora_loop_is_one_capture_and_one_solve_within_hf_checkpointing_peak() -> None:
    model = _lora()
    original = copy.deepcopy(model)
    largest = _batch(2, 64, seed=0)
    hf = copy.deepcopy(model)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _, hf_peak = _step(hf, largest)
    keep_all = chkpt_opt.plan(  # use_cache is not given: plan() adds it as optimize does
        original, (), example_kwargs=largest, budget=10**12, solver="keep_all", profile_times=False
    )
    assert keep_all.profile.peak_bytes > hf_peak  # the budget asks for recomputation
    budget = keep_all.static.resident_bytes + hf_peak

    chkpt_opt.optimize(model, budget=budget, time_limit_s=5)
    loop = [largest, _batch(2, 64, seed=1), _batch(2, 64, seed=2), _batch(1, 64, seed=3)]
    attachment = chkpt_opt.attachment_of(model)
    for batch in loop:
        grads, peak = _step(model, batch)
        expected, _ = _step(original, batch)
        assert grads.keys() == expected.keys() and any("lora_A" in n for n in grads)
        # Not bitwise: the captured program sums the gradients reaching a LoRA layer's
        # input in another order than eager autograd (its keep-all rewrite alone differs
        # by ~4e-9 on some lora_B gradients), so equal up to that rounding.
        torch.testing.assert_close(grads, expected, rtol=1e-5, atol=1e-8)
        runner = attachment.last_runner
        assert runner is not None
        assert runner.resident_bytes + peak <= runner.predicted_peak_bytes <= budget
    stats = attachment.stats
    # The batch of 1 is captured once on fake tensors to check that it runs the symbolic
    # program (torch.export's ranges start at 2), and is not planned.
    assert (stats.calls, stats.captures, stats.solves, stats.size_one_checks) == (4, 1, 1, 1)
    (runner,) = attachment.runners  # one plan, serving both shapes
    assert runner.input_dims is not None
    summary = attachment.summary()
    assert summary.startswith("1 plan(s) kept") and "input_ids[1, 64]" in summary
