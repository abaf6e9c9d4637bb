"""Batches the loop fetches during a step (chkpt_opt.attachment.fetched_batches): found in
the loop's variables at the backward pass's start by the whole shape of a call's input, never
the call's own, the model's, or one there at the call; counted in the plans made after, and
a runner they put over the budget is planned again."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

import chkpt_opt
from chkpt_opt.attachment.compiled_call import CompiledCalls, compiled_training_call
from chkpt_opt.attachment.fetched_batches import fetch_watch, fetched_bytes, uncounted_fetch
from chkpt_opt.attachment.runner import Runner

WIDTH = 64


def _mlp(depth: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(depth)])


def test_only_a_tensor_shaped_as_an_input_and_new_since_the_call_counts() -> None:
    model = nn.Embedding(100, WIDTH)
    ids, labels = torch.randint(0, 100, (4, 16)), torch.randint(0, 100, (4, 16))
    earlier = {"input_ids": torch.randint(0, 100, (4, 16))}  # alive at the call: not fetched
    watch = fetch_watch(model, ((), {"input_ids": ids, "labels": labels}))
    assert watch.own_bytes == ids.nbytes + labels.nbytes
    assert fetched_bytes(watch) == 0
    nxt = [torch.randint(0, 100, (4, 16)), torch.randint(0, 100, (4, 16))]  # fetched
    longer = torch.randint(0, 100, (4, 24))  # another shape: not seen
    floats = torch.rand(4, 16)  # another dtype
    alias = ids[:]  # the call's own storage
    model.weight.grad = torch.zeros_like(model.weight)  # the model's
    assert fetched_bytes(watch) == sum(t.nbytes for t in nxt)
    # From another thread, as autograd runs a CUDA backward's hooks: still this loop's.
    seen = []
    worker = threading.Thread(target=lambda: seen.append(fetched_bytes(watch)))
    worker.start()
    worker.join()
    assert seen == [sum(t.nbytes for t in nxt)]
    del earlier, longer, floats, alias


def test_a_fetch_that_puts_a_runner_over_the_budget_is_planned_again() -> None:
    model = _mlp()
    x = torch.randn(32, WIDTH)
    chkpt_opt.optimize(model, budget=10**12, optimizer=None, profile_times=False)
    model(x).sum().backward()
    (runner,) = chkpt_opt.attachment_of(model).runners
    budget = runner.predicted_peak_bytes + 100
    assert uncounted_fetch(runner, 100, budget, model) == (100, False)
    assert uncounted_fetch(runner, 101, budget, model) == (101, True)
    counted = dataclasses.replace(runner, fetched_batch_bytes=101)
    assert uncounted_fetch(counted, 101, budget, model) == (0, False)


def test_a_loop_that_fetches_the_next_batch_mid_step_gets_it_counted() -> None:
    def loop(prefetch: bool) -> chkpt_opt.attachment.Attachment:
        model = _mlp()
        chkpt_opt.optimize(model, budget=10**12, optimizer=None, profile_times=False)
        x = torch.randn(32, WIDTH)
        for _ in range(3):  # gradients accumulate: the second call is another key
            out = model(x).sum()
            if prefetch:
                x = torch.randn(32, WIDTH)  # the next batch, fetched before the backward
            out.backward()
        return chkpt_opt.attachment_of(model)

    plain, fetching = loop(False), loop(True)
    assert plain.fetched_share == 0.0
    assert [r.fetched_batch_bytes for r in plain.runners] == [0, 0]
    # seen at the first backward (its plan still fits: it keeps serving); the plan made
    # for the next call counts one batch more, resident
    assert fetching.fetched_share == 1.0
    first, second = fetching.runners
    assert (first.fetched_batch_bytes, second.fetched_batch_bytes) == (0, 32 * WIDTH * 4)
    (plain_second,) = [r for r in plain.runners if r.key.grads_held]
    assert second.resident_bytes - plain_second.resident_bytes == 32 * WIDTH * 4


def _prefetching_loop(
    model: nn.Module, steps: int, call: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> None:
    """``steps`` steps of ``model`` (through ``call`` where given), nanoGPT's way."""
    x = torch.randn(256, WIDTH)
    for _ in range(steps):
        model.zero_grad(set_to_none=True)  # one key: the same runner each step
        out = (model if call is None else call)(x).sum()
        x = torch.randn(256, WIDTH)  # the next batch, fetched before the backward
        out.backward()


def _keep_all_runner() -> Runner:
    """The keep-all runner of the MLP below, at its own predicted peak."""
    probe = _mlp(8)
    chkpt_opt.optimize(probe, budget=10**12, optimizer=None, profile_times=False)
    _prefetching_loop(probe, 1)
    (keep_all,) = chkpt_opt.attachment_of(probe).runners
    return keep_all


def test_a_plan_the_fetch_puts_over_the_budget_is_made_again_counting_it() -> None:
    loop = _prefetching_loop
    keep_all = _keep_all_runner()
    model = _mlp(8)  # a budget that keeping everything meets to the byte
    chkpt_opt.optimize(
        model, budget=keep_all.predicted_peak_bytes, optimizer=None, profile_times=False
    )
    loop(model, 3)
    attachment = chkpt_opt.attachment_of(model)
    (runner,) = attachment.runners
    assert attachment.stats.captures == 2  # the first plan, over by the fetch, made again
    assert runner.fetched_batch_bytes == 256 * WIDTH * 4
    assert runner.predicted_peak_bytes <= keep_all.predicted_peak_bytes
    assert runner.schedule != keep_all.schedule  # it recomputes to make room


def test_under_torch_compile_a_fetched_batch_is_counted_and_the_plan_made_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """nanoGPT's train.py compiles by default and fetches mid-step: the compiled path
    (compiled_training_call, as dynamo reaches it) watches the loop too. Inductor and the
    compiled step's measurement are stood in for by the eager module and its prediction."""
    monkeypatch.setattr(CompiledCalls, "module_for", lambda self, runner: runner.module)
    monkeypatch.setattr(
        CompiledCalls,
        "_measure",
        lambda self, runner, args, kwargs: runner.predicted_peak_bytes - runner.resident_bytes,
    )
    keep_all = _keep_all_runner()
    model = _mlp(8)  # a budget that keeping everything meets to the byte
    chkpt_opt.optimize(
        model, budget=keep_all.predicted_peak_bytes, optimizer=None, profile_times=False
    )
    attachment = chkpt_opt.attachment_of(model)
    _prefetching_loop(model, 3, lambda x: compiled_training_call(attachment, (x,), {}))
    twin = attachment.compiled.twin
    (runner,) = twin.runners
    assert twin.stats.captures == 2  # the first plan, over by the fetch, made again
    assert twin.fetched_share == 1.0
    assert runner.fetched_batch_bytes == 256 * WIDTH * 4
    assert runner.predicted_peak_bytes <= keep_all.predicted_peak_bytes
    assert runner.schedule.regions  # it recomputes to make room
