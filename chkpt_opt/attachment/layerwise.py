"""The layer-wise form of the attachment, for models that FSDP2 shards.

``fully_shard`` installs hooks on each decoder layer: all-gather the layer's parameters
before its forward, reshard them after, all-gather again before its backward. The
whole-graph attachment runs one captured ATen graph over the parameters, so those hooks
would not fire. Here the model's own forward runs, every layer is still called as a
module (its hooks fire), and the plan is lowered to per-layer decisions applied in place:
each chosen layer's ``forward`` runs under non-reentrant ``torch.utils.checkpoint``
inside the module call, so FSDP2's all-gather happens before the checkpoint and its
recomputation replays the layer's compute alone, no collective.

The plan is made for one rank (:mod:`chkpt_opt.step_budget.sharding`) from example inputs, before
``fully_shard`` (a sharded model's DTensor parameters cannot be captured). The exact
schedule is lowered with :func:`chkpt_opt.export.layers.lower_to_layers` (whole layers
checkpointed, layers added until the budget is met), and the lowered schedule's peak and
extra compute are reported beside the exact schedule's: what per-layer granularity costs.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from chkpt_opt.attachment.call_inputs import training_kwargs
from chkpt_opt.attachment.held_outputs import droppable, dropping_outputs
from chkpt_opt.errors import BudgetError, InfeasibleBudgetError, ScheduleError
from chkpt_opt.export.layers import Lowering, find_layers, lower_to_layers
from chkpt_opt.export.sac import dispatched_ops, lower_to_sac, selective_policy
from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes, storage_owners
from chkpt_opt.memory_model.region_replay import replayed_ops
from chkpt_opt.memory_model.schedule import Schedule, cacheable_ops
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.step_budget.budget import format_bytes
from chkpt_opt.step_budget.sharding import predicted_rank_peak_bytes

log = logging.getLogger(__name__)


class CheckpointedForward:
    """What a chosen layer's ``forward`` is while the plan is attached: its own forward
    under non-reentrant checkpointing while it trains, as it is otherwise.

    Attributes:
        module: the layer.
        own_forward: a forward the instance carried before (None: its class's).
        saved: for a selective policy, the ops whose outputs it caches (full overload
            name -> occurrences within one call, :func:`chkpt_opt.export.sac.lower_to_sac`);
            None: the whole layer is recomputed.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        own_forward: Callable[..., Any] | None,
        saved: dict[str, tuple[int, ...]] | None = None,
    ) -> None:
        self.module = module
        self.own_forward = own_forward
        self.saved = saved

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
        if self.saved is None:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        policy = selective_policy(self.saved)  # fresh counts for this call
        contexts = functools.partial(create_selective_checkpoint_contexts, policy)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)


@dataclass
class LayerwiseAttachment:
    """A plan attached layer by layer (see :func:`attach_layerwise`).

    Attributes:
        plan: the exact per-rank plan (:class:`chkpt_opt.api.Plan`).
        lowering: its per-layer lowering, with the lowered and exact peaks and extra
            compute.
        n_layers: the model's repeated layers.
        layer_paths: module paths of the layers checkpointed.
        predicted_peak_bytes: the whole step's predicted peak under what is attached
            (under FSDP2: :func:`chkpt_opt.step_budget.sharding.predicted_rank_peak_bytes`, FSDP2's
            buffers placed in time).
        exact_plan_peak_bytes: the same prediction for the exact plan.
        schedule: what is attached, as a schedule of the plan's graph (one region per
            checkpointed layer, the ops selective policies cache as cached ops).
        overhead: its extra compute (fraction of the step).
        policies: the layers with a selective policy: module path -> the ops it caches
            (:attr:`CheckpointedForward.saved`); empty where whole layers are recomputed.
    """

    plan: Any
    lowering: Lowering
    n_layers: int
    layer_paths: tuple[str, ...]
    predicted_peak_bytes: int
    exact_plan_peak_bytes: int
    schedule: Schedule
    overhead: float
    policies: dict[str, dict[str, tuple[int, ...]]] = field(default_factory=dict)
    _modules: list[torch.nn.Module] = field(default_factory=list, repr=False)

    def summary(self) -> str:
        """The budget split, the exact plan, and what its per-layer lowering costs."""
        low = self.lowering
        exact_step = self.exact_plan_peak_bytes
        placed = ""
        if self.plan.sharding is not None and self.plan.sharding.shards_states:
            placed = ", FSDP2's buffers placed in time (the budget split bounds them)"
        how = "whole"
        if self.policies:
            how = f"{len(self.policies)} with a selective policy caching what the plan keeps"
        return "\n".join(
            [
                self.plan.summary(),
                f"layer-wise: {len(self.layer_paths)} of {self.n_layers} layers "
                f"checkpointed, {how} ({', '.join(self.layer_paths) or 'none'})",
                f"  predicted peak {format_bytes(self.predicted_peak_bytes)} (exact plan "
                f"{format_bytes(exact_step)}){placed}; extra compute {self.overhead:.1%} "
                f"(exact plan {low.exact_overhead:.1%}, whole layers {low.lowered_overhead:.1%})",
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


def attach_layerwise(
    model: torch.nn.Module,
    example_inputs: Any,
    example_kwargs: dict[str, Any] | None,
    *,
    outputs_held: bool | None = None,
    selective: bool = False,
    **plan_settings: Any,
) -> LayerwiseAttachment:
    """Plans one rank's step of ``model`` on the example inputs (``plan_settings`` as
    :func:`chkpt_opt.plan` takes them: ``budget``, ``sharding``, ...), lowers the plan to
    whole layers and checkpoints those layers in place. ``outputs_held=False``: the loop
    drops the outputs beside the loss before the backward pass (the lowering and the
    predicted peak count them freed); otherwise they count as held (the layer-wise
    attachment does not observe the loop). ``selective=True``: every layer the plan
    recomputes any op of is checkpointed with a selective-checkpoint policy that caches the
    layer's ops the plan keeps (:func:`selective_layer_schedule`), where that fits the
    budget; whole layers otherwise.

    Raises:
        BudgetError: no example inputs (the plan is made ahead, before ``fully_shard``).
        InfeasibleBudgetError: no schedule fits, or even every layer checkpointed does not
            (the message gives the budget the lowering needs).
        ScheduleError: the model has no repeated layers to checkpoint.
    """
    from chkpt_opt.api import plan as make_plan
    from chkpt_opt.solvers.registry import solver_settings

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
    kwargs = training_kwargs(model, example_kwargs)  # the rules plan() follows too
    was_training = model.training
    model.train()
    try:
        with torch.enable_grad():
            made = make_plan(model, args, example_kwargs=kwargs, **plan_settings)
    finally:
        model.train(was_training)
    if made.schedule.staged:  # per-op stages: no per-layer setting expresses them
        log.info("chkpt_opt: the plan is staged; lowering the best plan without stages")
        made = made.for_compile(
            time_limit_s=plan_settings.get("time_limit_s"),
            solver_settings=solver_settings(
                gap=plan_settings.get("gap"), stall_s=plan_settings.get("stall_s")
            ),
        )
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
    attached_schedule = lowering.schedule
    policies: dict[str, dict[str, tuple[int, ...]]] = {}
    if selective:
        chosen = fitting_selective_schedule(graph, made.schedule, made.activation_budget_bytes)
        if chosen is not None:
            captured = made.traced.captured
            issued = dispatched_ops(captured.module, captured.flat_inputs)
            attached_schedule = chosen
            modules = lower_to_sac(graph, chosen, issued).modules
            policies = {path: saved for path, saved in modules.items() if saved}
        else:
            log.info("selective layers do not fit the budget; whole layers are checkpointed")
    chosen_spans = set(attached_schedule.spans(graph))
    paths = tuple(
        f"{layers.container}.{k}" for k, span in enumerate(layers.spans) if span in chosen_spans
    )
    profile = simulate(graph, attached_schedule)
    peak = made.static.step_peak_bytes(profile.peak_bytes)
    exact = made.static.step_peak_bytes(lowering.exact_peak_bytes)
    if made.sharding is not None:  # FSDP2's buffers placed in time, not bounded
        peak = predicted_rank_peak_bytes(graph, attached_schedule, made.sharding, made.static)
        exact = predicted_rank_peak_bytes(graph, made.schedule, made.sharding, made.static)
    attached = LayerwiseAttachment(
        made,
        lowering,
        len(layers.spans),
        paths,
        peak,
        exact,
        attached_schedule,
        profile.overhead,
        policies,
    )
    for path in paths:
        module = model.get_submodule(path)
        own = module.__dict__.get("forward")
        module.__dict__["forward"] = CheckpointedForward(module, own, policies.get(path))
        attached._modules.append(module)
    log.info("chkpt_opt layer-wise plan for %s:\n%s", type(model).__name__, attached.summary())
    return attached


def selective_layer_schedule(graph: CostGraph, schedule: Schedule) -> Schedule:
    """``schedule`` expressed per layer with selective policies: one region per layer that
    ``schedule`` recomputes any op of, caching the layer's ops whose outputs ``schedule``
    keeps: ops outside its regions, its cached ops, and ops a later region or an op
    outside reads (a keep-set region keeps its inputs). Only ops a policy may cache are
    cached (:func:`chkpt_opt.memory_model.schedule.cacheable_ops`; views and the like are
    recomputed), and only those the layer's recomputation reaches (it stops at its last saved
    tensor); ops outside the layers are kept. A layer whose recomputation would take every
    cacheable op it reaches from the cache is left as it is."""
    order = ordered_nodes(graph)
    region_of = {n: k for k, region in enumerate(schedule.regions) for n in region}
    recomputed = schedule.recomputed_nodes()
    cacheable = cacheable_ops(graph)

    def kept(node: str) -> bool:
        if node not in recomputed:
            return True
        return any(region_of.get(user) != region_of[node] for user in graph.successors(node))

    regions: list[tuple[str, ...]] = []
    saved: set[str] = set()
    owner = storage_owners(graph)
    for start, stop in find_layers(graph).spans:
        names = order[start:stop]
        # only ops the layer's recomputation reaches: it never takes a later op's cache
        reached = set(replayed_ops(graph, tuple(names), owner))
        cached = {n for n in names if n in cacheable and n in reached and kept(n)}
        if any(n in cacheable and n not in cached for n in reached):  # else nothing saved
            regions.append(tuple(names))
            saved.update(cached)
    return Schedule(regions=tuple(regions), saved=frozenset(saved))


def fitting_selective_schedule(
    graph: CostGraph, schedule: Schedule, budget_bytes: int
) -> Schedule | None:
    """:func:`selective_layer_schedule` within ``budget_bytes`` (the simulated forward and
    backward peak): where it peaks above, the cached ops that hold the most bytes per
    second of compute they save are recomputed instead, the fewest that fit (a binary
    search over that order). None: nothing to checkpoint, or even caching nothing in those
    layers does not fit."""
    chosen = selective_layer_schedule(graph, schedule)
    nodes = graph.nodes

    def bytes_per_second(node: str) -> float:
        held = sum(int(b) for b in nodes[node]["outputs"].values())
        return held / max(float(nodes[node]["fwd_time_s"]), 1e-12)

    costly_first = sorted(chosen.saved, key=lambda n: (-bytes_per_second(n), n))

    def caching_from(k: int) -> Schedule:
        return Schedule(regions=chosen.regions, saved=frozenset(costly_first[k:]))

    def fits(k: int) -> bool:
        return simulate(graph, caching_from(k)).peak_bytes <= budget_bytes

    if not chosen.regions or not fits(len(costly_first)):
        return None
    low, high = -1, len(costly_first)  # fits(high); fits(low) unknown
    while high - low > 1:
        middle = (low + high) // 2
        if middle >= 0 and fits(middle):
            high = middle
        else:
            low = middle
    return caching_from(high)
