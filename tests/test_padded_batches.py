"""Padded batches of Hugging Face models, fed as a training loop feeds them: keyword inputs
with an ``attention_mask`` that pads the end of every sequence and ``labels`` of -100
there, one step ``outputs = model(**batch); outputs.loss.backward()``.

The step differentiates the loss alone (the logits get no gradient); the cost graph used
to seed a gradient into the logits as well and predicted a Llama's keep-all step 5-12%
above its measured peak (:mod:`chkpt_opt.graphs.tracer.step_outputs`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import chkpt_opt
from chkpt_opt.api import Plan, plan_traced
from chkpt_opt.errors import GraphFormatError
from chkpt_opt.graphs.costgraph import check_graph, grad_outputs
from chkpt_opt.graphs.io import graph_from_dict, graph_to_dict
from chkpt_opt.graphs.tracer.step_outputs import grad_outputs as step_grad_outputs
from chkpt_opt.graphs.tracer.storage import StorageTracker

transformers = pytest.importorskip("transformers")

VOCAB, WIDTH, BATCH, SEQ, PADDED = 1024, 64, 2, 64, 12


def _llama() -> Any:
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=WIDTH,
            intermediate_size=4 * WIDTH,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            attn_implementation="sdpa",
        )
    )


def _gpt2() -> Any:
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=WIDTH,
            n_layer=2,
            n_head=4,
            n_positions=SEQ,
            attn_implementation="sdpa",
        )
    )


def _bert() -> Any:
    return transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=WIDTH,
            intermediate_size=4 * WIDTH,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=SEQ,
            attn_implementation="sdpa",
        )
    )


FAMILIES: dict[str, Callable[[], Any]] = {"llama": _llama, "gpt2": _gpt2, "bert": _bert}


def _padded_batch(model: Any) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[:, -PADDED:] = 0
    labels[:, -PADDED:] = -100
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if "use_cache" in model.config.to_dict():
        batch["use_cache"] = False
    return batch


def _step_peak(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """The exact peak of ``outputs = model(**batch); outputs.loss.backward()`` (CPU)."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(0)
    with StorageTracker() as tracker:
        outputs = model(**batch)
        outputs.loss.backward()
        del outputs
    return tracker.peak_bytes


def _keep_all(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Plan:
    return chkpt_opt.plan(
        model, (), example_kwargs=batch, budget=10**15, optimizer=None, solver="keep_all"
    )


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def planned(request: pytest.FixtureRequest) -> tuple[str, Any, dict[str, torch.Tensor], Plan]:
    torch.manual_seed(0)
    model = FAMILIES[request.param]().train()
    batch = _padded_batch(model)
    return request.param, model, batch, _keep_all(model, batch)


def test_keep_all_prediction_matches_the_padded_step(planned: Any) -> None:
    name, model, batch, keep_all = planned
    measured = _step_peak(model, batch)
    predicted = keep_all.profile.peak_bytes
    assert abs(predicted / measured - 1) <= 0.03, (name, predicted, measured)
    # The rewrite runs what was predicted.
    assert abs(_step_peak(keep_all.apply(), batch) / measured - 1) <= 0.001, name
    # The loss alone receives the step's gradient; the logits are outputs held to the end.
    graph = keep_all.graph
    assert len(graph.graph["outputs"]) >= 2 and len(grad_outputs(graph)) == 1, name


def test_a_plan_below_keep_all_measures_at_most_its_prediction(planned: Any) -> None:
    name, _, batch, keep_all = planned
    budget = keep_all.static.resident_bytes + int(0.6 * keep_all.profile.peak_bytes)
    made = plan_traced(keep_all.traced, budget=budget, optimizer=None, time_limit_s=5)
    assert made.profile.peak_bytes <= made.activation_budget_bytes
    assert _step_peak(made.apply(), batch) <= made.profile.peak_bytes, name


def test_the_step_differentiates_the_loss_of_a_mapping_and_every_tensor_otherwise() -> None:
    x = torch.ones(3, requires_grad=True)
    loss, logits = (x * 2).sum(), x * 3
    assert step_grad_outputs({"logits": logits, "loss": loss}) == [loss]
    assert step_grad_outputs((loss, logits)) == [loss, logits]
    # A loss that needs no gradient leaves the rule for every other output.
    assert step_grad_outputs({"loss": loss.detach(), "logits": logits}) == [logits]


def test_grad_outputs_round_trip_and_are_checked(planned: Any) -> None:
    graph = planned[3].graph
    again = graph_from_dict(graph_to_dict(graph))
    assert grad_outputs(again) == grad_outputs(graph)
    again.graph["grad_outputs"] = ["no_such_node"]
    with pytest.raises(GraphFormatError, match="grad_outputs"):
        check_graph(again)


def _dropping_peak(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """The exact peak of ``model(**batch).loss.backward()`` (Trainer's loop: the logits
    dropped when the forward returns)."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(0)
    with StorageTracker() as tracker:
        model(**batch).loss.backward()
    return tracker.peak_bytes


def test_plan_captures_a_llama_as_it_ships_as_optimize_does() -> None:
    """``plan`` on a Llama from its config (``use_cache=True``) and a padded batch without
    ``use_cache``: captured as the attachment captures it (``use_cache=False`` added), and
    with ``outputs_held=False`` planned for a loop that drops the logits: keep-all within
    3% of that loop's peak, and at HF checkpointing's peak a plan that measures within it,
    as predicted."""
    torch.manual_seed(0)
    model = _llama().train()
    assert model.config.use_cache
    batch = {k: v for k, v in _padded_batch(model).items() if k != "use_cache"}
    keep_all = chkpt_opt.plan(
        model,
        (),
        example_kwargs=batch,
        budget=10**15,
        optimizer=None,
        solver="keep_all",
        outputs_held=False,
        profile_times=False,
    )
    measured = _dropping_peak(model, batch)
    assert abs(keep_all.profile.peak_bytes / measured - 1) <= 0.03
    assert keep_all.graph.graph["outputs"] == grad_outputs(keep_all.graph)  # logits dropped

    hf = copy.deepcopy(model)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_peak = _dropping_peak(hf, batch)
    made = chkpt_opt.plan(
        model,
        (),
        example_kwargs=batch,
        budget=keep_all.static.resident_bytes + hf_peak,
        optimizer=None,
        outputs_held=False,
        time_limit_s=10,
    )
    assert made.graph.graph["cost_model"] == "measured-cpu"  # as optimize() plans on the CPU
    assert "timed_choice" in made.result.stats
    planned = _dropping_peak(made.apply(), batch)  # the model's call: use_cache filled in
    assert planned <= hf_peak
    assert abs(made.profile.peak_bytes / planned - 1) <= 0.03
