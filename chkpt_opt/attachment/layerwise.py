"""The layer-wise form of the attachment, for models that FSDP2 shards.

``fully_shard`` installs hooks on each decoder layer: all-gather the layer's parameters
before its forward, reshard them after, all-gather again before its backward. The
whole-graph attachment runs one captured ATen graph over the parameters, so those hooks
would not fire. Here the model's own forward runs, every layer is still called as a
module (its hooks fire), and the plan is lowered to per-layer decisions applied in place:
each chosen layer's ``forward`` runs under non-reentrant ``torch.utils.checkpoint``
inside the module call, so FSDP2's all-gather happens before the checkpoint and its
recomputation replays the layer's compute alone, no collective.

The plan is made for one rank (:mod:`chkpt_opt.sharding`) from example inputs, before
``fully_shard`` (a sharded model's DTensor parameters cannot be captured). The exact
schedule is lowered with :func:`chkpt_opt.export.layers.lower_to_layers` (whole layers
checkpointed, layers added until the budget is met), and the lowered schedule's peak and
extra compute are reported beside the exact schedule's: what per-layer granularity costs.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from chkpt_opt.attachment.held_outputs import droppable, dropping_outputs
from chkpt_opt.budget import format_bytes
from chkpt_opt.errors import BudgetError, InfeasibleBudgetError, ScheduleError
from chkpt_opt.export.layers import Lowering, find_layers, lower_to_layers
from chkpt_opt.sharding import predicted_rank_peak_bytes

log = logging.getLogger(__name__)


class CheckpointedForward:
    """What a chosen layer's ``forward`` is while the plan is attached: its own forward
    under non-reentrant checkpointing while it trains, as it is otherwise.

    Attributes:
        module: the layer.
        own_forward: a forward the instance carried before (None: its class's).
    """

    def __init__(self, module: torch.nn.Module, own_forward: Callable[..., Any] | None) -> None:
        self.module = module
        self.own_forward = own_forward

    def bound(self) -> Callable[..., Any]:
        """The layer's own forward (its class's, read at each call: ``fully_shard`` swaps
        the class for a subclass with the same forward)."""
        if self.own_forward is not None:
            return self.own_forward
        return type(self.module).forward.__get__(self.module)

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        return self.bound()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.bound()
        if not (self.module.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)


@dataclass
class LayerwiseAttachment:
    """A plan attached layer by layer (see :func:`attach_layerwise`).

    Attributes:
        plan: the exact per-rank plan (:class:`chkpt_opt.api.Plan`).
        lowering: its per-layer lowering, with the lowered and exact peaks and extra
            compute.
        n_layers: the model's repeated layers.
        layer_paths: module paths of the layers checkpointed whole.
        predicted_peak_bytes: the whole step's predicted peak under the lowering (under
            FSDP2: :func:`chkpt_opt.sharding.predicted_rank_peak_bytes`, FSDP2's buffers
            placed in time).
        exact_plan_peak_bytes: the same prediction for the exact plan.
    """

    plan: Any
    lowering: Lowering
    n_layers: int
    layer_paths: tuple[str, ...]
    predicted_peak_bytes: int
    exact_plan_peak_bytes: int
    _modules: list[torch.nn.Module] = field(default_factory=list, repr=False)

    def summary(self) -> str:
        """The budget split, the exact plan, and what its per-layer lowering costs."""
        low = self.lowering
        exact_step = self.exact_plan_peak_bytes
        placed = ""
        if self.plan.sharding is not None and self.plan.sharding.shards_states:
            placed = ", FSDP2's buffers placed in time (the budget split bounds them)"
        return "\n".join(
            [
                self.plan.summary(),
                f"layer-wise: {len(self.layer_paths)} of {self.n_layers} "
                f"layers checkpointed whole ({', '.join(self.layer_paths) or 'none'})",
                f"  predicted peak {format_bytes(self.predicted_peak_bytes)} (exact plan "
                f"{format_bytes(exact_step)}){placed}; extra compute "
                f"{low.lowered_overhead:.1%} (exact plan {low.exact_overhead:.1%})",
                *(f"  note: {note}" for note in low.notes),
            ]
        )

    def detach(self) -> None:
        """Gives every checkpointed layer its own forward back."""
        for module in self._modules:
            wrapper = module.__dict__.pop("forward", None)
            if isinstance(wrapper, CheckpointedForward) and wrapper.own_forward is not None:
                module.__dict__["forward"] = wrapper.own_forward
        self._modules.clear()


def _training_kwargs(model: torch.nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``use_cache=False`` added where the model takes it (as the attachment does)."""
    try:
        takes = "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes = False
    return {**kwargs, "use_cache": False} if takes and "use_cache" not in kwargs else kwargs


def attach_layerwise(
    model: torch.nn.Module,
    example_inputs: Any,
    example_kwargs: dict[str, Any] | None,
    *,
    outputs_held: bool | None = None,
    **plan_settings: Any,
) -> LayerwiseAttachment:
    """Plans one rank's step of ``model`` on the example inputs (``plan_settings`` as
    :func:`chkpt_opt.plan` takes them: ``budget``, ``sharding``, ...), lowers the plan to
    whole layers and checkpoints those layers in place. ``outputs_held=False``: the loop
    drops the outputs beside the loss before the backward pass (the lowering and the
    predicted peak count them freed); otherwise they count as held (the layer-wise
    attachment does not observe the loop).

    Raises:
        BudgetError: no example inputs (the plan is made ahead, before ``fully_shard``).
        InfeasibleBudgetError: no schedule fits, or even every layer checkpointed does not
            (the message gives the budget the lowering needs).
        ScheduleError: the model has no repeated layers to checkpoint.
    """
    from chkpt_opt.api import plan as make_plan

    if example_inputs is None and example_kwargs is None:
        raise BudgetError(
            "the layer-wise plan (FSDP2) is made ahead from example inputs, before "
            "fully_shard shards the parameters; pass example_inputs= or example_kwargs= with "
            "one rank's largest local batch."
        )
    if isinstance(example_inputs, torch.Tensor):
        args: tuple[Any, ...] = (example_inputs,)
    else:
        args = tuple(example_inputs or ())
    kwargs = _training_kwargs(model, dict(example_kwargs or {}))
    was_training = model.training
    model.train()
    try:
        with torch.enable_grad():
            made = make_plan(model, args, example_kwargs=kwargs, **plan_settings)
    finally:
        model.train(was_training)
    graph = made.graph
    if outputs_held is False and droppable(graph):
        graph = dropping_outputs(graph)
    try:
        lowering = lower_to_layers(
            graph,
            made.schedule,
            target="torchtitan",
            budget_bytes=made.activation_budget_bytes,
        )
    except ValueError as err:
        raise ScheduleError(f"the layer-wise plan needs repeated layers: {err}") from None
    peak = made.static.step_peak_bytes(lowering.lowered_peak_bytes)
    if not lowering.meets_budget:
        raise InfeasibleBudgetError(
            f"budget {made.budget.text!r} = {format_bytes(made.budget.total_bytes)} is met by "
            f"the exact plan but not by whole layers: every layer checkpointed peaks at "
            f"{format_bytes(peak)} ({peak} bytes). Raise the budget to at least that, or "
            "reduce the local batch.",
            budget_bytes=made.activation_budget_bytes,
            min_feasible_bytes=peak,
        )
    layers = find_layers(graph)
    paths = tuple(f"{layers.container}.{k}" for k in lowering.layers)
    exact = made.static.step_peak_bytes(lowering.exact_peak_bytes)
    if made.sharding is not None:  # FSDP2's buffers placed in time, not bounded
        peak = predicted_rank_peak_bytes(graph, lowering.schedule, made.sharding, made.static)
        exact = predicted_rank_peak_bytes(graph, made.schedule, made.sharding, made.static)
    attached = LayerwiseAttachment(made, lowering, len(layers.spans), paths, peak, exact)
    for path in paths:
        module = model.get_submodule(path)
        own = module.__dict__.get("forward")
        module.__dict__["forward"] = CheckpointedForward(module, own)
        attached._modules.append(module)
    log.info("chkpt_opt layer-wise plan for %s:\n%s", type(model).__name__, attached.summary())
    return attached
