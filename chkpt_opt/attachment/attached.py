"""A plan attached to a model in place: its forward, while training, runs the schedule.

:class:`Attachment` holds the settings of :func:`chkpt_opt.optimize` and the rewritten
modules (:class:`Runner`) that serve the calls it has seen, by
:class:`~chkpt_opt.attachment.call_key.CallKey`. Outside training (``eval()``,
``torch.no_grad()``, ``generate()``) the model's own forward runs, untouched. A training
call is served by

* the runner of its key, or one captured with symbolic sizes whose example was at least
  as large in every dimension (one graph for a smaller last batch or a shorter padded
  length: no capture at all; its prediction at the largest shapes bounds the smaller
  ones, every tensor's size growing with the sizes it is made of);
* else a new capture: with symbolic sizes where torch.export allows and the graph
  computes what the capture at the call's own shapes does (the model's eager program),
  else at its own shapes. Its schedule is one already made for a call of its family at
  least as large, where the simulator shows it fits the budget at this shape; else one
  stored on disk for this graph and these settings (``plan_dir``); else solved (logged:
  the first call, a larger batch than any planned, a new keyword set, another
  precision). A budget no schedule can meet at that shape raises, rather than running
  over it.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from chkpt_opt.attachment.call_capture import CallCapture
from chkpt_opt.attachment.call_inputs import measures_times, training_kwargs
from chkpt_opt.attachment.call_key import CallKey, call_key
from chkpt_opt.attachment.compiled_call import compiled_training_call
from chkpt_opt.attachment.fetched_batches import (
    fetch_watch,
    input_bytes,
    uncounted_fetch,
    watch_fetches,
)
from chkpt_opt.attachment.held_batches import held_batch_bytes
from chkpt_opt.attachment.held_outputs import outputs_held_hint, watch, watched_positions
from chkpt_opt.attachment.plan_store import load_stored, plan_path
from chkpt_opt.attachment.runner import (
    AttachmentStats,
    Runner,
    plans_summary,
    reusable_schedule,
    served_keys,
)
from chkpt_opt.attachment.size_one import serving_at_size_one
from chkpt_opt.attachment.step_state import planned_autocast, step_traced
from chkpt_opt.codegen import rewrite_module
from chkpt_opt.errors import InfeasibleBudgetError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.tracer import Traced
from chkpt_opt.graphs.tracer.dynamic_dims import program_ops
from chkpt_opt.measurement import measure_traced
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers.deadline import Deadline, stage
from chkpt_opt.step_budget.budget import Budget, format_bytes
from chkpt_opt.step_budget.sharding import Sharding, per_rank_graph
from chkpt_opt.step_budget.whole_step import OptimizerArg, activation_budget

log = logging.getLogger(__name__)

MAX_RUNNERS = 128
"""Rewritten modules kept at once (least recently used dropped first); each holds only
code, its tensors are the model's."""


@dataclass
class Attachment:
    """The plan attached to ``model`` (see :func:`chkpt_opt.optimize` for the settings)."""

    model: torch.nn.Module
    budget: Budget
    solver: str = "auto"
    optimizer: OptimizerArg = "adamw"
    time_limit_s: float | None = None
    solver_settings: dict[str, Any] = field(default_factory=dict)
    tracer: str = "auto"
    profile_times: bool | None = None
    plan_dir: Path | None = None
    own_forward: Callable[..., Any] | None = None
    sharding: Sharding | None = None
    for_compile: bool = False  # plans what torch.compile runs (see .compiled_call)
    compiled: Any = field(default=None, repr=False)  # its CompiledCalls, once compiled
    stats: AttachmentStats = field(default_factory=AttachmentStats)
    _runners: OrderedDict[CallKey, Runner] = field(default_factory=OrderedDict, repr=False)
    # (family, made for a loop that drops the outputs) -> (input elements, schedule)
    _families: dict[tuple[object, ...], list[tuple[int, Schedule]]] = field(
        default_factory=dict, repr=False
    )
    capture: CallCapture = field(init=False, repr=False)  # the capture rules (.call_capture)
    # Whether the loop holds the outputs beside the loss through the backward pass, as
    # observed at the last backward (None before the first: plans count them held).
    outputs_held: bool | None = field(default=None, repr=False)
    _planned_families: set[tuple[object, ...]] = field(default_factory=set, repr=False)
    _planning: tuple[Deadline, dict[str, float]] | None = field(default=None, repr=False)
    last_runner: Runner | None = field(default=None, repr=False)
    """The runner of the latest training call."""
    fetched_share: float = field(default=0.0, repr=False)
    """The bytes of the batches the loop fetches during a step, as a share of a call's own
    input bytes (observed at the start of backward passes, .fetched_batches)."""
    _fetches_watched: set[CallKey] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        self.capture = CallCapture(self.model, self.own_forward, self.tracer)

    # -- the call -------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.capture.capturing or not self.model.training or not torch.is_grad_enabled():
            return self.call_own_forward(*args, **kwargs)
        if torch.compiler.is_compiling():  # planned outside dynamo, run compiled
            return compiled_training_call(self, args, kwargs)
        kwargs = self.training_kwargs(kwargs)
        with planned_autocast():  # autocast's weight cache off, as planned (.step_state)
            runner = self.runner_for(args, kwargs)
            self.last_runner = runner
            out = self.watched_call(runner, runner.module, args, kwargs)
        if runner.watched:
            watch(out, runner.watched, self._observe_outputs)
        return out

    def watched_call(
        self, runner: Runner, module: Callable[..., Any], args: tuple[Any, ...], kwargs: dict
    ) -> Any:
        """``module`` (``runner``'s, eager or compiled) called, and, at the first call of
        each runner, the loop watched for a batch fetched during the step
        (:mod:`.fetched_batches`)."""
        fetches = None
        if runner.key not in self._fetches_watched:
            self._fetches_watched.add(runner.key)
            fetches = fetch_watch(self.model, (args, kwargs))
        out = module(*args, **kwargs)
        if fetches is not None:
            own_bytes = fetches.own_bytes
            watch_fetches(out, fetches, lambda n: self._observe_fetches(runner, n, own_bytes))
        return out

    def call_own_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own forward, as it was before the plan was attached."""
        if self.own_forward is not None:
            return self.own_forward(*args, **kwargs)
        return type(self.model).forward(self.model, *args, **kwargs)

    def own_forward_bound(self) -> Callable[..., Any]:
        """The model's own forward as a bound callable (for its signature)."""
        if self.own_forward is not None:
            return self.own_forward
        return type(self.model).forward.__get__(self.model)

    def training_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The keyword inputs of a training call (:func:`.call_inputs.training_kwargs`)."""
        return training_kwargs(self.model, kwargs, self.own_forward_bound())

    def runner_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Runner:
        """The runner of this call's key: one seen before, one whose symbolic sizes admit
        it (the capture of the largest shapes first), or a new capture."""
        key = call_key(self.model, args, kwargs)
        self.stats.calls += 1
        runner = self._runners.get(key)
        if runner is not None:
            self._runners.move_to_end(key)
            return runner
        symbolic = [r for r in self._runners.values() if r.input_dims is not None]
        symbolic.sort(key=lambda r: -r.key.input_elements)
        runner = next((r for r in symbolic if r.serves(key)), None)
        if runner is None:
            # Outside the caller's dispatch modes (a memory tracker, a FLOP counter): they
            # would watch, and slow, the capture and the solve rather than the step.
            with _disable_current_modes():
                runner = serving_at_size_one(
                    symbolic, key, lambda: self.capture.fixed(args, kwargs), self.stats
                ) or self._prepare(key, args, kwargs)
        self._runners[key] = runner
        while len(self._runners) > MAX_RUNNERS:
            self._runners.popitem(last=False)
        return runner

    @property
    def runners(self) -> list[Runner]:
        """The runners kept, each once, least recently used first (a symbolic capture
        serves many keys: :meth:`summary` lists the shapes each served)."""
        return [runner for runner, _ in served_keys(self._runners)]

    def summary(self) -> str:
        """The distinct plans kept, with the shapes each served, and the stats."""
        return plans_summary(self._runners, self.stats)

    # -- capture and plan -----------------------------------------------------------------

    def _prepare(self, key: CallKey, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Runner:
        start = time.perf_counter()
        name = type(self.model).__name__
        log.info("chkpt_opt: capturing %s for a new input signature: %s", name, key.describe())
        self._planning = (Deadline.after(self.time_limit_s), {})  # one limit for every stage
        # the other batches as the call finds them, and those the loop fetches in a step
        held = (
            held_batch_bytes(self.model, (args, kwargs)),
            math.ceil(self.fetched_share * input_bytes((args, kwargs))),
        )
        with stage("capture", *self._planning):
            traced = self.capture.measured(key, args, kwargs, self._planning[0])
            planned_before = key.family in self._planned_families  # a family that grows
            grown = self.capture.grown(key, traced, args, kwargs) if planned_before else None
        if grown is not None:
            try:
                return self._planned(*grown, start, held)
            except InfeasibleBudgetError as err:
                log.info("chkpt_opt: planning at the rounded-up sizes failed (%s)", err)
        return self._planned(key, traced, start, held)

    def _planned(
        self, key: CallKey, traced: Traced, start: float, batches: tuple[int, int]
    ) -> Runner:
        """The runner for ``key``'s capture: a schedule reused, stored or solved, for a
        step that holds ``sum(batches)`` bytes of other batches beside it: those alive at the
        call (.held_batches) and those fetched during the step (.fetched_batches)."""
        self._planned_families.add(key.family)
        held_bytes = sum(batches)
        if held_bytes:
            log.info(
                "chkpt_opt: the loop holds %s of other batches beside this call's; planned "
                "resident",
                format_bytes(held_bytes),
            )
        watched = watched_positions(traced.graph, traced.captured.module)
        can_drop = bool(watched)
        drops = can_drop and self.outputs_held is False
        traced = step_traced(  # the step's memory around the call (.step_state)
            traced, other_batch_bytes=held_bytes, drops_outputs=drops, grads_held=key.grads_held
        )
        _, static, act = activation_budget(
            traced.graph, self.budget, optimizer=self.optimizer, sharding=self.sharding
        )
        graph = per_rank_graph(traced.graph, self.sharding)
        elements = key.input_elements
        made = self._families.setdefault((key.family, drops), [])
        held_made = self._families.get((key.family, False), []) if drops else []
        schedule, source = reusable_schedule(key, [*made, *held_made], graph, act), "reused"
        if schedule is None:
            schedule, source = self._stored(graph), "stored"
        if schedule is None:
            with outputs_held_hint(can_drop and not drops):
                schedule, source = self._solved(traced), "solved"
        if source != "reused":
            made.append((elements, schedule))
        module = rewrite_module(traced.captured.fresh_module(), graph, schedule)
        peak = static.step_peak_bytes(simulate(graph, schedule).peak_bytes)
        stage_s = (self._planning or (None, {}))[1]  # capture, op timing, solve...
        self.stats.count_capture(source, time.perf_counter() - start, peak, stage_s)
        self._planning = None
        log.info(
            "chkpt_opt: %s schedule for %s: %d recompute regions, predicted step peak %s "
            "(budget %s); %.1f s",
            source,
            key.describe(),
            len(schedule.regions),
            format_bytes(peak),
            format_bytes(self.budget.total_bytes),
            time.perf_counter() - start,
        )
        dims = traced.captured.input_dims
        return Runner(
            key,
            module,
            schedule,
            peak,
            static.resident_bytes,
            source,
            input_dims=dims if dims is not None and dims.symbolic else None,
            drops_outputs=drops,
            watched=watched,
            program=tuple(program_ops(traced.captured.module)) if dims and dims.symbolic else None,
            held_batch_bytes=held_bytes,
            fetched_batch_bytes=batches[1],
        )

    def _profiles_times(self, graph: CostGraph) -> bool:
        """Whether a solve measures op times (:func:`.call_inputs.measures_times`)."""
        return measures_times(self.profile_times, graph)

    def _settings(self) -> tuple[object, ...]:
        optimizer = self.optimizer
        if optimizer is not None and not isinstance(optimizer, str):
            optimizer = type(optimizer).__name__
        solver = (self.solver, *sorted(self.solver_settings.items()))
        settings = (self.budget.total_bytes, optimizer, solver, self.profile_times)
        return settings if self.sharding is None else (*settings, self.sharding)

    def _stored(self, graph: CostGraph) -> Schedule | None:
        if self.plan_dir is None:
            return None
        return load_stored(plan_path(self.plan_dir, graph, self._settings()), graph)

    def _solved(self, traced: Traced) -> Schedule:
        from chkpt_opt.api import plan_traced

        start = time.perf_counter()
        deadline, seconds = self._planning or (Deadline.after(self.time_limit_s), {})
        with stage("op timing", deadline, seconds):
            measure_traced(
                traced, profile_times=self._profiles_times(traced.graph), deadline=deadline
            )
        log.info(
            "chkpt_opt: solving for %s (%d ops) under %s, solver %s",
            type(self.model).__name__,
            traced.graph.number_of_nodes(),
            format_bytes(self.budget.total_bytes),
            self.solver,
        )
        made = plan_traced(
            traced,
            budget=self.budget,
            solver=self.solver,
            optimizer=self.optimizer,
            sharding=self.sharding,
            deadline=deadline,  # the solve and the timed choice get what capture left
            stage_s=seconds,
            solver_settings=self.solver_settings,
        )
        if self.for_compile:  # the plan the compiled step can run (no nesting, unpacking)
            made = made.for_compile(
                time_limit_s=self.time_limit_s, solver_settings=self.solver_settings
            )
        self.stats.solve_s += time.perf_counter() - start
        log.info("chkpt_opt plan for %s:\n%s", type(self.model).__name__, made.summary())
        if self.plan_dir is not None:
            self.plan_dir.mkdir(parents=True, exist_ok=True)
            made.save(plan_path(self.plan_dir, traced.graph, self._settings()))
        return made.schedule

    def _observe_outputs(self, held: bool) -> None:
        """What the start of a backward pass showed of the outputs beside the loss."""
        if held and self.outputs_held is not True:
            if self.last_runner is not None and self.last_runner.drops_outputs:
                log.warning(
                    "chkpt_opt: the loop held %s's outputs beside the loss through this "
                    "backward pass, which its schedule counted as dropped (as at earlier "
                    "steps): this step may have peaked above its prediction by their bytes. "
                    "Schedules count them held from now on.",
                    type(self.model).__name__,
                )
            self.outputs_held = True
            self._forget(drops_outputs=True)
        elif not held and self.outputs_held is None:
            log.info(
                "chkpt_opt: the loop drops %s's outputs beside the loss before the "
                "backward pass; the schedules made with them held still fit (they count "
                "their bytes) and keep serving; new captures count them dropped",
                type(self.model).__name__,
            )
            self.outputs_held = False

    def _observe_fetches(self, runner: Runner, alive_bytes: int, own_bytes: int) -> None:
        """Counts a batch fetched during the step from now on; plans ``runner`` again
        where it puts it over the budget (:func:`.fetched_batches.uncounted_fetch`)."""
        extra, over = uncounted_fetch(runner, alive_bytes, self.budget.total_bytes, self.model)
        if extra and own_bytes:
            self.fetched_share += extra / own_bytes
        if over:
            for key in [k for k, r in self._runners.items() if r is runner]:
                del self._runners[key]

    def _forget(self, *, drops_outputs: bool) -> None:
        """Drops the runners and schedules made for one assumption on the outputs."""
        for key in [k for k, r in self._runners.items() if r.droppable]:
            if self._runners[key].drops_outputs == drops_outputs:
                del self._runners[key]
        for family in [f for f in self._families if f[1] == drops_outputs]:
            del self._families[family]

    def __getstate__(self) -> dict[str, Any]:
        # Copies and pickles keep the settings and the schedules, not the rewritten
        # modules (they are captured again on the first call).
        state = dict(self.__dict__)
        state["_runners"] = OrderedDict()
        state["last_runner"] = None
        state["_fetches_watched"] = set()
        return state


class AttachedForward:
    """What ``model.forward`` is while a plan is attached: calls the attachment.

    Its ``__wrapped__`` is the model's own forward, so ``inspect.signature(model.forward)``
    reads the model's own signature (``Trainer`` keeps the dataset columns it names, and
    passes ``num_items_in_batch`` where it sees ``**kwargs``).
    """

    def __init__(self, attachment: Attachment) -> None:
        self.attachment = attachment

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        return self.attachment.own_forward_bound()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.attachment(*args, **kwargs)
