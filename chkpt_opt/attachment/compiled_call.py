"""The attached plan under ``torch.compile``: planned outside dynamo, run by the compiled path.

``torch.compile(chkpt_opt.optimize(model, budget=B))`` (nanoGPT's and torchtitan's order)
and ``chkpt_opt.optimize(model, budget=B)`` then ``model.compile()`` both make dynamo
trace the model's call, and with it the attachment's forward. A training call there

* graph-breaks at the model's forward (:func:`compiled_training_call`, which dynamo does
  not trace: ``torch.compiler.disable``), where the planning runs as it runs eagerly:
  capture, op timing and solve, once per input signature, outside dynamo;
* plans what the compiled path can run (:meth:`~chkpt_opt.api.Plan.for_compile`: no
  nested regions, no unpacked ops, not staged; the best such plan at the same budget, or
  an :class:`~chkpt_opt.errors.InfeasibleBudgetError` naming the smallest budget a
  compiled plan needs). Those plans belong to a twin of the attachment
  (``for_compile=True``) with its own runners and schedules: eager training of the same
  model keeps its own plans (those it made that the compiled path runs as they are are
  reused where they fit);
* measures the compiled step of each new plan at its first call, and plans again at a
  budget lowered by what it measured above the budget (:meth:`CompiledCalls.runner_for`;
  an :class:`~chkpt_opt.errors.InfeasibleBudgetError` where no plan's compiled step fits):
  the simulator predicts eager bytes, and compiled kernels hold some percent more or less;
* runs the plan's rewritten module compiled by
  :func:`~chkpt_opt.export.partitioner.compile_module` (Inductor with the plan
  partitioner: the compiled backward keeps and recomputes what the plan keeps and
  recomputes, the path :mod:`chkpt_opt.export.compiled` measures), one compiled module per
  runner. PyTorch's own partitioner would recompute whole regions the plan keeps the
  outputs of and keep other tensors than the plan does (``tests/test_compiled.py``).

So the model's forward and backward are compiled by Inductor with the plan's decisions
whatever the outer ``torch.compile`` was given (its ``backend`` and ``mode`` apply to the
code around the model's call); ``fullgraph=True`` is refused by dynamo at that graph break
(its message gives the reason below), and a model compiled before a plan is attached to it
is refused (:func:`refuse_compiled`). Outside training (``eval()``, ``no_grad``) dynamo
traces the model's own forward, as without a plan. The compiled step does not watch
whether the loop holds the outputs beside the loss
(:mod:`~chkpt_opt.attachment.held_outputs`): its plans count them as the attachment's
``outputs_held`` says at the first compiled call (held where not known, the bound for
both loops), so no compiled call is planned again for it. It does watch, as the eager
call does, for a batch the loop fetches during the step (nanoGPT's ``train.py``, which
compiles by default; :mod:`~chkpt_opt.attachment.fetched_batches`): the twin's plans
count it from then on, and a runner it puts over the budget is planned again.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from chkpt_opt.errors import ChkptOptError, InfeasibleBudgetError
from chkpt_opt.step_budget.budget import Budget, format_bytes

if TYPE_CHECKING:
    from chkpt_opt.attachment.runner import Runner

# An attachment (:class:`~chkpt_opt.attachment.attached.Attachment`), which calls this
# module: typed by this name, not imported (no import cycle).
Attachment = Any

log = logging.getLogger(__name__)

COMPILED_SUBDIR = "compiled"
"""Where, under ``plan_dir``, the plans of the compiled step are kept (they are other
schedules than the eager plans of the same graph and settings)."""

_REASON = (
    "chkpt_opt plans the attached model outside dynamo (capture, op timing, solve) and "
    "runs the plan compiled with its own partitioner; call torch.compile without "
    "fullgraph=True on a model chkpt_opt.optimize attached a plan to"
)


MEASURED_PLANS = 3
"""Plans a compiled call makes (each measured) before it gives up on the budget."""


@dataclass
class CompiledCalls:
    """What serves an attachment's compiled training calls.

    Attributes:
        budget: the budget of the attachment (the step's, as the user gave it).
        twin: the attachment that plans them (``for_compile=True``): the settings and the
            statistics of the one it serves (one count for both), its own runners and
            schedules; its budget is lowered where a compiled step measured above the
            budget (see :meth:`runner_for`).
        compiled: each runner's module compiled (by the module's id), for the runners the
            twin keeps.
        measured: the peak (bytes created by forward and backward) measured of each
            compiled runner's step (by the module's id).
    """

    budget: Budget
    twin: Attachment
    compiled: dict[int, tuple[torch.nn.Module, Any]] = field(default_factory=dict)
    measured: dict[int, int] = field(default_factory=dict)

    def runner_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Runner:
        """The twin's runner for this call, its compiled step measured within the budget.

        The schedule's prediction is the eager op sequence's; compiled kernels hold other
        bytes (Inductor's buffers, decompositions that save other tensors: a few percent
        either way, see :mod:`chkpt_opt.export.compiled`). So the first call a runner
        serves runs two more steps on its inputs, model state and random numbers restored
        (compiling, then measuring: the allocator's events on the CPU, the CUDA
        allocator's peak on a GPU). Where the step's peak lies above the budget the twin
        plans again at a budget lowered by that excess (at most :data:`MEASURED_PLANS`
        plans).

        Raises:
            InfeasibleBudgetError: no plan's compiled step measured within the budget (the
                message says by how much the last one missed it), or no schedule the
                compiled path runs meets the budget at all.
        """
        last: Runner | None = None
        excess = 0
        for _ in range(MEASURED_PLANS):
            try:
                runner = self.twin.runner_for(args, kwargs)
            except InfeasibleBudgetError as err:
                if last is None:
                    raise
                raise self._missed(last, excess, err) from err
            key = id(runner.module)
            if key in self.measured or self.twin.sharding is not None:
                return runner  # measured before; under sharding a step is collective
            peak = self._measure(runner, args, kwargs)
            excess = runner.resident_bytes + peak - self.budget.total_bytes
            if excess <= 0:
                self.measured[key] = peak
                return runner
            last = runner
            self._plan_at(
                self.twin.budget.total_bytes - excess,
                f"the compiled step measured {format_bytes(excess)} above the budget",
            )
        assert last is not None
        raise self._missed(last, excess, None)

    def _missed(
        self, runner: Runner, excess: int, err: InfeasibleBudgetError | None
    ) -> InfeasibleBudgetError:
        """The error of a compiled step that measured ``excess`` bytes above the budget
        with ``runner``'s plan, where no other plan was found to fit (``err``: why the last
        plan could not be made)."""
        why = f" Planning below it: {err}" if err is not None else ""
        return InfeasibleBudgetError(
            f"budget {self.budget.text!r} = {format_bytes(self.budget.total_bytes)}: under "
            f"torch.compile the step of {type(self.twin.model).__name__} measured "
            f"{format_bytes(excess)} above it with a plan predicted at "
            f"{format_bytes(runner.predicted_peak_bytes)} (compiled kernels hold other bytes "
            f"than the eager prediction), after {MEASURED_PLANS} plans at most.{why} Raise "
            "the budget by at least that excess for the compiled step, or train eagerly.",
            budget_bytes=self.budget.total_bytes - runner.resident_bytes,
            min_feasible_bytes=None if err is None else err.min_feasible_bytes,
        )

    def _measure(self, runner: Runner, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """The peak of one compiled step of ``runner`` on this call's inputs (compiled by a
        step before it), the model's buffers, gradients and random numbers restored."""
        from chkpt_opt.measurement.module_state import preserved_state
        from chkpt_opt.measurement.step import (
            device_of,
            measure_step,
            measure_step_allocator,
            run_step,
        )

        module = self.module_for(runner)
        model = self.twin.model
        with preserved_state(model):
            with preserved_state(model):
                run_step(module, args, kwargs)
            if device_of(model, args).type == "cuda":
                return measure_step(module, args, kwargs).peak_bytes
            return measure_step_allocator(module, args, kwargs)

    def _plan_at(self, total_bytes: int, reason: str) -> None:
        """The twin made afresh at a budget of ``total_bytes`` (its plans made at the
        higher one dropped)."""
        log.info(
            "chkpt_opt: under torch.compile %s (%s), %s is planned again at %s",
            reason,
            format_bytes(self.budget.total_bytes),
            type(self.twin.model).__name__,
            format_bytes(total_bytes),
        )
        lower = total_bytes - self.budget.total_bytes
        budget = Budget(total_bytes=total_bytes, text=f"{self.budget.text} {lower:+} bytes")
        self.twin = _fresh_twin(self.twin, budget=budget)
        self.compiled.clear()
        self.measured.clear()

    def module_for(self, runner: Runner) -> Any:
        """``runner``'s module compiled with the plan partitioner (once per runner)."""
        entry = self.compiled.get(id(runner.module))
        if entry is None or entry[0] is not runner.module:
            from chkpt_opt.export.partitioner import compile_module  # Inductor, on demand

            kept = {id(r.module) for r in self.twin.runners}
            self.compiled = {k: v for k, v in self.compiled.items() if k in kept}
            self.measured = {k: v for k, v in self.measured.items() if k in kept}
            entry = (runner.module, compile_module(runner.module))
            self.compiled[id(runner.module)] = entry
        return entry[1]

    def __getstate__(self) -> dict[str, Any]:
        # Copies and pickles keep the twin's settings and schedules, not compiled code.
        return {**self.__dict__, "compiled": {}, "measured": {}}


def _fresh_twin(source: Attachment, **changes: Any) -> Attachment:
    """An attachment with ``source``'s settings and statistics (shared), and its own
    state at its defaults (no runners, schedules or planning under way)."""
    fresh = {
        f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(source)
        if f.init and (f.name.startswith("_") or f.name in ("last_runner", "compiled"))
    }
    return dataclasses.replace(source, **{**fresh, **changes})


def compiled_calls(attachment: Attachment) -> CompiledCalls:
    """The :class:`CompiledCalls` of ``attachment``, made at its first compiled call."""
    calls = attachment.compiled
    if calls is None:
        plan_dir = attachment.plan_dir
        held = attachment.outputs_held
        twin = _fresh_twin(
            attachment,
            for_compile=True,
            plan_dir=plan_dir / COMPILED_SUBDIR if plan_dir is not None else None,
            outputs_held=True if held is None else held,
            _families=_compilable_families(attachment),
        )
        calls = CompiledCalls(attachment.budget, twin)
        attachment.compiled = calls
        log.info(
            "chkpt_opt: %s is called under torch.compile: its training calls are planned "
            "outside dynamo, for the compiled path (no nested regions, unpacked ops or "
            "stages), measured, and run compiled with the plan partitioner",
            type(attachment.model).__name__,
        )
    return calls


def _compilable_families(attachment: Attachment) -> dict[tuple[object, ...], list[Any]]:
    """The schedules ``attachment`` made eagerly (``optimize`` with example inputs, or
    steps before compiling) that the compiled path runs as they are: the twin reuses them
    where they fit, as the attachment reuses its own (no solve)."""
    families = {
        family: [(n, s) for n, s in made if not (s.nested or s.unpacked or s.staged)]
        for family, made in attachment._families.items()
    }
    return {family: made for family, made in families.items() if made}


def refuse_compiled(model: torch.nn.Module) -> None:
    """Raises where ``model`` was compiled before a plan is attached to it.

    Raises:
        ChkptOptError: ``model`` is ``torch.compile``'s wrapper (``OptimizedModule``): its
            compiled code would call around the plan, not through it.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not loaded: nothing compiled
    if eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        inner = type(model._orig_mod).__name__
        raise ChkptOptError(
            f"chkpt_opt.optimize got a {inner} already compiled by torch.compile "
            "(an OptimizedModule): its compiled code runs the model's own forward, around "
            "the plan. Attach the plan first, then compile: "
            "model = torch.compile(chkpt_opt.optimize(model, budget=...)), or "
            "chkpt_opt.optimize(model, budget=...) then model.compile()."
        )


@torch.compiler.disable(reason=_REASON)
def compiled_training_call(
    attachment: Attachment, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A training call of ``attachment``'s model met by dynamo: planned here, outside it,
    and run by the runner's compiled module (see the module docstring)."""
    calls = compiled_calls(attachment)
    kwargs = calls.twin.training_kwargs(kwargs)
    runner = calls.runner_for(args, kwargs)
    attachment.last_runner = runner
    # a batch fetched during the step is counted by the twin's plans from then on
    return calls.twin.watched_call(runner, calls.module_for(runner), args, kwargs)
