"""Whether the loop holds the logits through the backward pass: observed at each backward,
planned for from the next call (chkpt_opt.attachment.held_outputs)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import chkpt_opt
from chkpt_opt.attachment.held_outputs import (
    droppable,
    dropping_outputs,
    watch,
)
from chkpt_opt.graphs.synthetic import chain_graph
from chkpt_opt.graphs.tracer.storage import StorageTracker
from chkpt_opt.memory_model.simulate import simulate
from tests.attachment.tiny_models import tiny_llama

transformers = pytest.importorskip("transformers")

VOCAB = 512


def _llama() -> Any:
    return tiny_llama(vocab=VOCAB, layers=2, max_positions=128)


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (4, 64), generator=gen)
    return {"input_ids": ids, "labels": torch.randint(0, VOCAB, (4, 64), generator=gen)}


def _step(model: torch.nn.Module, batch: dict[str, torch.Tensor], *, hold: bool) -> int:
    """One backward pass, the logits held through it or dropped first; the step's
    measured peak of bytes created."""
    model.zero_grad(set_to_none=True)
    with StorageTracker() as tracker:
        if hold:
            outputs = model(**batch)
            outputs.loss.backward()
            del outputs
        else:
            model(**batch).loss.backward()
    return tracker.peak_bytes


def test_a_loop_that_holds_the_logits_keeps_the_first_schedule() -> None:
    model = chkpt_opt.optimize(
        _llama(), budget=10**9, example_kwargs=_batch(), time_limit_s=5, profile_times=False
    )
    attachment = chkpt_opt.attachment_of(model)
    for _ in range(2):
        peak = _step(model, _batch(), hold=True)
    runner = attachment.runners[-1]
    assert attachment.outputs_held is True and not runner.drops_outputs
    assert attachment.stats.solves == 1
    assert runner.resident_bytes + peak <= runner.predicted_peak_bytes


def _batch_of(length: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(length)
    ids = torch.randint(0, VOCAB, (4, length), generator=gen)
    return {"input_ids": ids, "labels": torch.randint(0, VOCAB, (4, length), generator=gen)}


def test_logits_dropped_keep_the_schedule_made_with_them_held(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The issue: a loop that drops the logits paid a second full solve at its second step
    # (68 s, Llama 4 layers), though the plan made with the logits held still fit.
    model = chkpt_opt.optimize(
        _llama(), budget=10**9, example_kwargs=_batch(), time_limit_s=5, profile_times=False
    )
    attachment = chkpt_opt.attachment_of(model)
    held_plan = attachment.runners[-1]
    _step(model, _batch(), hold=False)
    assert attachment.outputs_held is False
    dropped_peak = _step(model, _batch(), hold=False)
    assert attachment.runners == [held_plan] and not held_plan.drops_outputs
    assert attachment.stats.solves == 1 and attachment.stats.captures == 1
    assert held_plan.resident_bytes + dropped_peak <= held_plan.predicted_peak_bytes
    # A new shape is captured for the logits dropped; the schedule made with them held
    # serves it where the simulator shows that it fits.
    longer_peak = _step(model, _batch_of(96), hold=False)
    longer = attachment.runners[-1]
    assert longer.drops_outputs and longer.source == "reused"
    assert attachment.stats.solves == 1 and attachment.stats.reuses == 1
    assert longer.resident_bytes + longer_peak <= longer.predicted_peak_bytes
    with caplog.at_level(logging.WARNING, logger="chkpt_opt"):
        _step(model, _batch(), hold=True)  # held again: the first plan counted them held
    assert "may have peaked above its prediction" not in caplog.text
    assert attachment.runners[0] is held_plan and attachment.outputs_held is True


def test_a_plan_made_with_the_logits_held_peaks_no_higher_where_they_are_dropped() -> None:
    model = _llama()
    made = chkpt_opt.plan(model, (), example_kwargs=_batch(), budget=10**9, optimizer=None)
    graph = made.graph
    lowest = chkpt_opt.smallest_peak(graph, time_limit_s=5).schedule
    for schedule in (made.schedule, lowest):
        held = simulate(graph, schedule).peak_bytes
        assert simulate(dropping_outputs(graph), schedule).peak_bytes <= held


def test_a_loop_said_to_drop_the_logits_that_holds_them_is_warned_and_planned_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = chkpt_opt.optimize(
        _llama(),
        budget=10**9,
        example_kwargs=_batch(),
        time_limit_s=5,
        profile_times=False,
        outputs_held=False,
    )
    attachment = chkpt_opt.attachment_of(model)
    dropped_plan = attachment.runners[-1]
    with caplog.at_level(logging.WARNING, logger="chkpt_opt"):
        _step(model, _batch(), hold=True)  # the loop changed: this step ran over its plan
    assert "may have peaked above its prediction" in caplog.text
    assert attachment.outputs_held is True and not attachment.runners
    held_peak = _step(model, _batch(), hold=True)
    replanned = attachment.runners[-1]
    assert not replanned.drops_outputs and attachment.stats.solves == 2
    logits_bytes = 4 * 64 * VOCAB * 4
    assert replanned.predicted_peak_bytes - dropped_plan.predicted_peak_bytes == logits_bytes
    assert replanned.resident_bytes + held_peak <= replanned.predicted_peak_bytes


def test_a_loop_said_to_drop_the_logits_is_planned_once() -> None:
    model = chkpt_opt.optimize(
        _llama(),
        budget=10**9,
        example_kwargs=_batch(),
        time_limit_s=5,
        profile_times=False,
        outputs_held=False,
    )
    attachment = chkpt_opt.attachment_of(model)
    assert attachment.runners[-1].drops_outputs
    peak = _step(model, _batch(), hold=False)
    runner = attachment.runners[-1]
    assert attachment.stats.solves == 1 and attachment.outputs_held is False
    assert runner.resident_bytes + peak <= runner.predicted_peak_bytes


def test_encoder_states_that_autograd_keeps_do_not_count_as_held() -> None:
    # T5 returns its encoder's last states, which every cross-attention saves: alive at
    # the backward pass whatever the loop does. The logits alone tell.
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).train()
    gen = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(1, VOCAB, (2, 24), generator=gen),
        "labels": torch.randint(1, VOCAB, (2, 12), generator=gen),
    }
    chkpt_opt.optimize(
        model, budget=10**9, example_kwargs=batch, time_limit_s=3, profile_times=False
    )
    attachment = chkpt_opt.attachment_of(model)
    runner = attachment.runners[-1]
    assert runner.watched == (1,)  # loss, logits, encoder_last_hidden_state
    graph_outputs = len(runner.module.graph.find_nodes(op="output")[0].args[0])
    assert graph_outputs == 3
    _step(model, batch, hold=False)
    assert attachment.outputs_held is False


def test_a_watch_sees_a_storage_kept_by_a_detached_copy() -> None:
    weight = torch.ones(3, requires_grad=True)
    seen: list[bool] = []
    out = {"loss": (weight * 2).sum(), "logits": weight * 3}
    kept = out["logits"].detach()  # no reference to the tensor, one to its storage
    watch(out, (1,), seen.append)
    loss = out.pop("loss")
    del out
    loss.backward()
    assert seen == [True]
    out = {"loss": (weight * 2).sum(), "logits": weight * 3}
    watch(out, (1,), seen.append)
    loss = out["loss"]
    del out
    loss.backward()
    assert seen == [True, False] and kept.sum() == 9


def test_dropping_outputs_is_refused_where_every_output_is_differentiated() -> None:
    graph = chain_graph(4)
    assert not droppable(graph)
    with pytest.raises(ValueError, match="droppable"):
        dropping_outputs(graph)
    graph.graph["outputs"] = sorted(graph.nodes)[:2]
    graph.graph["grad_outputs"] = graph.graph["outputs"][:1]
    dropped = dropping_outputs(graph)
    assert dropped.graph["outputs"] == graph.graph["outputs"][:1]
    assert "grad_outputs" not in dropped.graph and "grad_outputs" in graph.graph
    assert simulate(dropped, chkpt_opt.Schedule()).peak_bytes >= 0


def test_an_unmet_budget_counted_with_the_logits_held_says_how_to_drop_them() -> None:
    # 3.6 MB lies between the lowest step peaks with the logits held (3.93 MB) and dropped
    # (3.40 MB): the refusal names outputs_held=False, and that setting fits.
    with pytest.raises(chkpt_opt.InfeasibleBudgetError) as held:
        chkpt_opt.optimize(
            _llama(), budget="3.6MB", example_kwargs=_batch(), time_limit_s=5, profile_times=False
        )
    assert "outputs_held=False" in str(held.value)
    assert held.value.min_feasible_bytes > 3_600_000
    model = chkpt_opt.optimize(
        _llama(),
        budget="3.6MB",
        example_kwargs=_batch(),
        time_limit_s=5,
        profile_times=False,
        outputs_held=False,
    )
    runner = chkpt_opt.attachment_of(model).runners[-1]
    assert runner.drops_outputs and runner.predicted_peak_bytes <= 3_600_000
