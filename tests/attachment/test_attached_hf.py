"""``chkpt_opt.optimize(model, budget=...)`` on Hugging Face models in the loops people run:
the same object, every batch shape a loop feeds within the budget, the model's own code
outside training, save_pretrained, aliased and autocast inputs."""

from __future__ import annotations

import copy
import tempfile
from typing import Any

import pytest
import torch

import chkpt_opt
from chkpt_opt.errors import InfeasibleBudgetError
from chkpt_opt.graphs.tracer.storage import StorageTracker
from tests.attachment.tiny_models import tiny_llama

transformers = pytest.importorskip("transformers")

VOCAB = 512


def _llama() -> Any:
    return tiny_llama(vocab=VOCAB, layers=3)


def _batch(batch: int, seq: int, padded: int = 0, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    out = {"input_ids": ids, "labels": torch.randint(0, VOCAB, (batch, seq), generator=gen)}
    if padded:
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[:, seq - padded :] = 0
        out["attention_mask"] = mask
        out["labels"][:, seq - padded :] = -100
    return out


def _train_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[Any, int]:
    """``model(**batch).loss.backward()``; returns the gradients and the step's exact peak
    of bytes created (CPU storage tracker)."""
    for p in model.parameters():
        p.grad = None
    with StorageTracker() as tracker:
        model(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, tracker.peak_bytes


def _keep_all(model: torch.nn.Module, batch: dict[str, torch.Tensor], **kwargs: Any) -> Any:
    return chkpt_opt.plan(
        model,
        (),
        budget=10**12,
        example_kwargs={**batch, "use_cache": False},
        solver="keep_all",
        **kwargs,
    )


def test_a_loop_of_shapes_stays_in_budget_with_the_models_gradients() -> None:
    model = _llama()
    original = copy.deepcopy(model)
    keys = list(model.state_dict())
    largest = _batch(4, 96)
    keep_all = _keep_all(original, largest)
    budget = keep_all.static.resident_bytes + int(0.6 * keep_all.profile.peak_bytes)

    same = chkpt_opt.optimize(model, budget=budget, time_limit_s=5)
    assert same is model and type(model) is transformers.LlamaForCausalLM
    assert list(model.state_dict()) == keys

    loop = [
        largest,  # planned on this first batch
        _batch(2, 96, seed=1),  # a smaller last batch
        _batch(4, 70, seed=2),  # a shorter padded length
        _batch(4, 96, padded=20, seed=3),  # a padding mask: a new keyword set
        _batch(3, 64, padded=9, seed=4),
        _batch(2, 96, seed=5),  # seen shape again
    ]
    for batch in loop:
        _train_step(model, batch)  # a new shape is captured (and planned) first
        grads, peak = _train_step(model, batch)
        expected, _ = _train_step(original, batch)
        assert all(torch.equal(grads[n], expected[n]) for n in expected)
        runner = chkpt_opt.attachment_of(model).runners[-1]
        measured = runner.resident_bytes + peak
        assert measured <= runner.predicted_peak_bytes <= budget
        # The loop drops the logits before the backward pass; a schedule made with them
        # held keeps serving (it fits with them dropped too), and one made for them dropped
        # is exact up to the allocator's rounding where the runner was captured at this
        # batch's shapes (else at larger ones).
        if runner.drops_outputs and runner.key.shapes == {
            k: tuple(v.shape) for k, v in batch.items()
        }:
            assert runner.predicted_peak_bytes - measured <= 0.001 * measured
    attachment = chkpt_opt.attachment_of(model)
    stats = attachment.stats
    # The first batch's schedule, made with the logits held, keeps serving once its backward
    # shows them dropped (no second plan for it). Without a mask the model takes other
    # branches at symbolic sizes (an explicit causal mask), so each shape is captured alone
    # and reuses the first schedule; with a mask one symbolic capture serves the smaller
    # padded batch too.
    assert attachment.outputs_held is False
    assert (stats.captures, stats.solves, stats.reuses) == (4, 2, 2)
    symbolic = [r for r in attachment.runners if r.input_dims is not None]
    assert len({id(r) for r in symbolic}) == 1 and symbolic[0].key.shapes["input_ids"] == (4, 96)
    assert list(model.state_dict()) == keys


def test_lengths_that_creep_upwards_are_planned_once_more_at_a_rounded_up_length() -> None:
    model = _llama()
    original = copy.deepcopy(model)
    keep_all = _keep_all(original, _batch(2, 56, padded=4))
    budget = keep_all.static.resident_bytes + int(0.7 * keep_all.profile.peak_bytes)
    chkpt_opt.optimize(model, budget=budget, time_limit_s=3, profile_times=False)
    attachment = chkpt_opt.attachment_of(model)
    for length, seed in [(40, 1), (50, 2), (52, 3), (51, 4), (45, 5)]:
        batch = _batch(2, length, padded=3, seed=seed)
        grads, peak = _train_step(model, batch)
        expected, _ = _train_step(original, batch)
        assert all(torch.equal(grads[n], expected[n]) for n in expected)
        runner = attachment.last_runner
        assert runner is not None
        assert runner.resident_bytes + peak <= runner.predicted_peak_bytes <= budget
    # 40 tokens planned as they came; 50 grew past that plan and was planned at 52 (the
    # next eighth of 32), whose capture with symbolic sizes serves 52, 51 and 45.
    assert (attachment.stats.captures, attachment.stats.solves) == (2, 2)
    assert runner.key.shapes["input_ids"] == (2, 52)


def test_outside_training_the_model_runs_its_own_forward() -> None:
    model = _llama()
    original = copy.deepcopy(model).eval()
    chkpt_opt.optimize(
        model, budget=10**9, example_kwargs=_batch(2, 32), time_limit_s=5, profile_times=False
    )
    attachment = chkpt_opt.attachment_of(model)
    assert attachment.stats.captures == 1
    ids = torch.randint(0, VOCAB, (1, 9))
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original(ids).logits)
        generated = model.generate(ids, max_new_tokens=4, do_sample=False)
        assert torch.equal(generated, original.generate(ids, max_new_tokens=4, do_sample=False))
    model.train()
    with torch.no_grad():  # no backward: nothing to plan
        model(**_batch(2, 32))
    _train_step(model, _batch(2, 32))  # the plan made ahead serves it
    assert attachment.stats.captures == 1
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        loaded = transformers.LlamaForCausalLM.from_pretrained(folder)
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values())
    )
    assert chkpt_opt.detach(model) is model and "forward" not in model.__dict__
    assert chkpt_opt.attachment_of(model) is None


def test_a_plan_made_on_aliased_inputs_trains_with_distinct_labels() -> None:
    model = _llama()
    original = copy.deepcopy(model)
    ids = _batch(2, 32)["input_ids"]
    chkpt_opt.optimize(
        model, budget=10**9, example_kwargs={"input_ids": ids, "labels": ids}, profile_times=False
    )
    distinct = {"input_ids": ids, "labels": _batch(2, 32, seed=7)["labels"]}
    distinct["labels"][:, :5] = -100
    grads, _ = _train_step(model, distinct)
    expected, _ = _train_step(original, distinct)
    assert chkpt_opt.attachment_of(model).stats.captures == 1  # the same key: no new capture
    assert all(torch.equal(grads[n], expected[n]) for n in expected)
    # plan(...).apply() likewise
    optimized = chkpt_opt.plan(
        original,
        (),
        budget=10**9,
        example_kwargs={"input_ids": ids, "labels": ids, "use_cache": False},
    ).apply()
    with torch.no_grad():
        got = optimized(**distinct, use_cache=False).loss
        want = original(**distinct, use_cache=False).loss
    assert torch.equal(got, want)


def test_bf16_autocast_and_bf16_weights_get_captures_of_their_own() -> None:
    model = _llama()
    original = copy.deepcopy(model)
    chkpt_opt.optimize(model, budget=10**9, time_limit_s=5, profile_times=False)
    batch = _batch(2, 32)
    _train_step(model, batch)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        grads, _ = _train_step(model, batch)
        expected, _ = _train_step(original, batch)
    assert all(torch.equal(grads[n], expected[n]) for n in expected)
    model.to(torch.bfloat16)
    original.to(torch.bfloat16)
    grads, _ = _train_step(model, batch)
    expected, _ = _train_step(original, batch)
    assert all(torch.equal(grads[n], expected[n]) for n in expected)
    assert chkpt_opt.attachment_of(model).stats.captures == 3


def test_plans_survive_restarts_in_plan_dir(tmp_path: Any) -> None:
    batch = _batch(2, 32)
    first = chkpt_opt.optimize(
        _llama(), budget=10**9, plan_dir=tmp_path, time_limit_s=5, profile_times=False
    )
    _train_step(first, batch)
    assert chkpt_opt.attachment_of(first).stats.solves == 1 and list(tmp_path.iterdir())
    resumed = chkpt_opt.optimize(
        _llama(), budget=10**9, plan_dir=tmp_path, time_limit_s=5, profile_times=False
    )
    _train_step(resumed, batch)
    stats = chkpt_opt.attachment_of(resumed).stats
    assert (stats.solves, stats.stored) == (0, 1)


def test_a_batch_no_schedule_fits_raises_with_the_smallest_budget() -> None:
    model, batch = _llama(), _batch(2, 32)
    keep_all = _keep_all(model, batch, optimizer=None)
    budget = keep_all.static.resident_bytes + keep_all.profile.peak_bytes // 20
    chkpt_opt.optimize(model, budget=budget, optimizer=None, time_limit_s=5, profile_times=False)
    with pytest.raises(InfeasibleBudgetError, match="Raise the budget to at least") as raised:
        _train_step(model, batch)
    assert raised.value.min_feasible_bytes > budget
