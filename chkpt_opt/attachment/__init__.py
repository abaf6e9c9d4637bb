"""The drop-in form: ``model = chkpt_opt.optimize(model, budget="20GB")``.

The plan is attached to the model in place, as ``gradient_checkpointing_enable()`` attaches
Hugging Face's checkpointing: the model keeps its class, Parameters, ``state_dict`` keys,
``save_pretrained`` and ``generate``; while it trains (``model.training`` and gradients
enabled) its forward runs the schedule, planned from the first training batch (or ahead,
from example inputs), and every later input signature is served (see
:mod:`~chkpt_opt.attachment.attached`). :func:`detach` gives the model its own forward back.
``chkpt_opt.plan(...).apply()`` remains for a separate optimized module.

Example:
    >>> import torch, chkpt_opt
    >>> net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    >>> same = chkpt_opt.optimize(net, budget="1MB", optimizer=None)
    >>> same is net
    True
    >>> net(torch.randn(32, 64)).sum().backward()   # planned on this first batch
    >>> net(torch.randn(20, 64)).sum().backward()   # a smaller one: the same schedule
    >>> chkpt_opt.detach(net) is net
    True
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from chkpt_opt.attachment.attached import AttachedForward, Attachment
from chkpt_opt.attachment.call_inputs import positional
from chkpt_opt.attachment.call_key import CallKey
from chkpt_opt.attachment.compiled_call import refuse_compiled
from chkpt_opt.attachment.layerwise import LayerwiseAttachment, attach_layerwise
from chkpt_opt.attachment.runner import AttachmentStats, Runner
from chkpt_opt.errors import ChkptOptError
from chkpt_opt.solvers.registry import solver_settings
from chkpt_opt.step_budget.budget import Budget, parse_budget
from chkpt_opt.step_budget.sharding import Sharding
from chkpt_opt.step_budget.whole_step import OptimizerArg

__all__ = [
    "AttachedForward",
    "Attachment",
    "AttachmentStats",
    "CallKey",
    "LayerwiseAttachment",
    "Runner",
    "attachment_of",
    "detach",
    "optimize",
]

log = logging.getLogger(__name__)

PLANNING_LIMIT_S = 60.0
"""``optimize``'s default ``time_limit_s``: what planning a new call signature may take, all
stages together (capture, op timing, solve, timed choice). A 32-layer Llama of width 256
took 429 s at its first step with only the solve limited (60 s; 268 s of timed choice):
``benchmarks/results/plan_cost.md``."""

OPTIMIZE_GAP = 0.05
"""``optimize``'s default ``gap`` for solver ``auto``: a schedule proven within 5% of the
least extra compute returns at once (``auto`` alone and :func:`chkpt_opt.plan` keep 1%). On
a Hugging Face Llama of 32 layers at its own checkpointing's peak the 1% gap was never met
and the solve took 33.6 s of the 60 s default; at 5% it returns in 6.4 s with a plan within 5%
of the bound, stepping at 0.97 of HF checkpointing's time
(``benchmarks/results/plan_cost.md``, Runs 3 and 4); 5% of the recompute is about 1% of the
step where recomputation costs a fifth of it."""

OPTIMIZE_STALL_S = 10.0
"""``optimize``'s default ``stall_s`` for solver ``auto``: its searches beyond keep-set stop
once 10 s have passed without a better schedule (``auto`` alone and :func:`chkpt_opt.plan`
search to the limit). On BERT at its layers' peak no search after the keep-set proof
improved on it: 60.6 s -> 43.0 s of a 60 s limit, the same plan
(``benchmarks/results/auto_stall/``)."""

_ATTRIBUTE = "_chkpt_opt_attachment"
_LAYERWISE = "_chkpt_opt_layerwise"


def optimize(
    model: torch.nn.Module,
    example_inputs: Any = None,
    *,
    budget: int | str | Budget,
    example_kwargs: dict[str, Any] | None = None,
    solver: str = "auto",
    optimizer: OptimizerArg = "adamw",
    time_limit_s: float | None = PLANNING_LIMIT_S,
    tracer: str = "auto",
    profile_times: bool | None = None,
    plan_dir: str | Path | None = None,
    outputs_held: bool | None = None,
    sharding: Sharding | None = None,
    layerwise: bool | None = None,
    selective_layers: bool = False,
    gap: float | None = None,
    stall_s: float | None = None,
) -> torch.nn.Module:
    """Attaches a plan that keeps every training step of ``model`` within ``budget``;
    returns ``model`` itself.

    Args:
        model: the model; it keeps its class, Parameters and ``state_dict`` keys.
        example_inputs: positional inputs of one training step, to plan now rather than on
            the first training call (``example_kwargs`` likewise). Plan for the largest
            batch the loop feeds: smaller ones reuse that schedule.
        budget: peak memory of the whole training step (``"20GB"``, ``"20GiB"``, bytes,
            ``"80%"`` of the CUDA device), as in :func:`chkpt_opt.plan`.
        solver, optimizer, tracer: as in :func:`chkpt_opt.plan`.
        profile_times: whether a solve weighs recomputation by op times measured on the
            model's device (a few forward passes, at each solve) rather than estimated.
            None (the default): measured wherever the model's tensors are real, the CPU
            included, so plans are fast where they run (the schedule may then differ from
            run to run by the timing noise); False: the roofline estimate, deterministic.
        time_limit_s: what planning each new call signature (the first batch, and any
            larger or new one) may take, every stage from one deadline: the capture, op
            timing, the solve (which returns earlier where its result is proven within
            ``auto``'s gap) and, where the model's own layer checkpointing fits the budget
            too, the timed choice between it and the plan on that batch (at most a quarter
            of the limit; skipped where three rounds do not fit). Default
            :data:`PLANNING_LIMIT_S` (60 s); None: no limit on the whole (the solver's own
            60 s, the timed choice's six rounds, an unbounded capture).
        plan_dir: a folder where plans are kept across restarts (keyed by the graph's
            fingerprint, the settings and the versions), so a resumed job does not solve
            again.
        outputs_held: whether the loop holds the model's outputs beside the loss (the
            logits) through the backward pass. None (the default): observed at each
            backward pass, the first plan counting them held and the next call planned
            again once a backward shows them dropped; False: dropped before the backward
            (``Trainer``, ``model(**batch).loss.backward()``), so the first plan is the
            only one; True: held (``outputs = model(**batch); outputs.loss.backward()``).
            A backward that shows the loop holds them where plans counted them dropped is
            logged as a warning and planned for.
        sharding: plan one rank of sharded training (FSDP2 or DDP,
            :class:`~chkpt_opt.step_budget.sharding.Sharding`): ``budget`` is then per rank and
            every call one rank's local batch.
        layerwise: run the model's own forward with the plan lowered to whole decoder
            layers checkpointed in place (:mod:`~chkpt_opt.attachment.layerwise`), so that
            per-layer hooks (FSDP2's ``fully_shard``) fire; planned at once from
            ``example_inputs``/``example_kwargs``, which it requires. None (the default):
            layer-wise under FSDP2 sharding, the whole-graph plan otherwise. Call
            ``optimize`` before ``fully_shard``.
        selective_layers: layer-wise, checkpoint each layer the plan recomputes any op of
            with a selective-checkpoint policy caching the layer's ops the plan keeps,
            instead of recomputing whole layers (where that fits the budget).
        gap: the relative gap at which a solve stops, as in :func:`chkpt_opt.plan`. None
            (the default): :data:`OPTIMIZE_GAP` (5%) for solver ``auto``, the solver's own
            for the others.
        stall_s: the seconds without a better schedule after which a solve's searches
            stop, as in :func:`chkpt_opt.plan`. None (the default): :data:`OPTIMIZE_STALL_S`
            (10 s) for solver ``auto``, the solver's own for the others.

    Raises:
        BudgetError: an unreadable budget (at once).
        InfeasibleBudgetError: no schedule serves a call within the budget, stating the
            smallest budget that can: here, with example inputs (and the model left
            without a plan), else from that training call.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    refuse_compiled(model)  # compile after optimize (.compiled_call)
    detach(model)
    if solver == "auto":
        gap = OPTIMIZE_GAP if gap is None else gap
        stall_s = OPTIMIZE_STALL_S if stall_s is None else stall_s
    if layerwise is None:
        layerwise = sharding is not None and sharding.strategy == "fsdp2"
    if layerwise:
        model.__dict__[_LAYERWISE] = attach_layerwise(
            model,
            example_inputs,
            example_kwargs,
            outputs_held=outputs_held,
            selective=selective_layers,
            budget=budget,
            solver=solver,
            optimizer=optimizer,
            time_limit_s=time_limit_s,
            tracer=tracer,
            profile_times=profile_times,
            sharding=sharding,
            gap=gap,
            stall_s=stall_s,
        )
        return model
    if any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules()):
        log.warning(
            "%s has Hugging Face gradient checkpointing enabled; chkpt_opt plans the model as "
            "it runs, checkpoints included. Call model.gradient_checkpointing_disable() first "
            "to let the plan choose what to recompute.",
            type(model).__name__,
        )
    attachment = Attachment(
        model=model,
        budget=parse_budget(budget, device_total_bytes=_device_total_bytes(model)),
        solver=solver,
        optimizer=optimizer,
        time_limit_s=time_limit_s,
        solver_settings=solver_settings(gap=gap, stall_s=stall_s),
        tracer=tracer,
        profile_times=profile_times,
        plan_dir=Path(plan_dir) if plan_dir is not None else None,
        own_forward=model.__dict__.get("forward"),
        outputs_held=outputs_held,
        sharding=sharding,
    )
    model.__dict__[_ATTRIBUTE] = attachment
    model.__dict__["forward"] = AttachedForward(attachment)
    if example_inputs is not None or example_kwargs is not None:
        try:
            _plan_ahead(attachment, example_inputs, example_kwargs or {})
        except ChkptOptError:
            detach(model)  # the model as it was: trains unplanned, or optimize() again
            raise
    return model


def _plan_ahead(attachment: Attachment, example_inputs: Any, kwargs: dict[str, Any]) -> None:
    """Plans the call of the example inputs now: a budget no schedule meets for them
    raises :class:`~chkpt_opt.errors.InfeasibleBudgetError` here, from ``optimize``."""
    args = positional(example_inputs)
    model = attachment.model
    was_training = model.training
    model.train()
    try:
        with torch.enable_grad():
            attachment.runner_for(args, attachment.training_kwargs(kwargs))
    finally:
        model.train(was_training)


def detach(model: torch.nn.Module) -> torch.nn.Module:
    """Removes the plan :func:`optimize` attached: ``model`` runs its own forward again.
    Returns ``model``; a model with no plan attached is returned as it is."""
    layerwise = model.__dict__.pop(_LAYERWISE, None)
    if layerwise is not None:
        layerwise.detach()
    attachment = model.__dict__.pop(_ATTRIBUTE, None)
    if attachment is None:
        return model
    del model.__dict__["forward"]
    if attachment.own_forward is not None:
        model.__dict__["forward"] = attachment.own_forward
    return model


def attachment_of(model: torch.nn.Module) -> Attachment | LayerwiseAttachment | None:
    """The plan attached to ``model`` by :func:`optimize`, or None: its runners (each
    distinct plan once, with its schedule and predicted peak; ``summary()`` lists them with
    the input shapes each served) and its stats; or, for a layer-wise plan, the plan, its
    lowering and the layers checkpointed."""
    return model.__dict__.get(_ATTRIBUTE) or model.__dict__.get(_LAYERWISE)


def _device_total_bytes(model: torch.nn.Module) -> int | None:
    first = next(iter(model.parameters()), None)
    if first is not None and first.device.type == "cuda":
        return int(torch.cuda.get_device_properties(first.device).total_memory)
    return None
