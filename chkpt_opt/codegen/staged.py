"""Codegen of a staged schedule (:mod:`chkpt_opt.memory_model.staged`): the forward runs every op
once under saved-tensor hooks, and a pre-hook on each stage's autograd node recomputes the
stage's ops just before the node runs, holding each value as
:func:`chkpt_opt.memory_model.staged.sequence.lower_staged` (the simulator's reference) says.

:func:`~chkpt_opt.codegen.staged_plan.staged_plan` names, before anything runs, the
instance of a storage each use takes. At run time (:class:`StagedScope`, its hooks pushed
by a ``with``, so an error in the forward leaves none behind):

* every op of the graph runs through :func:`run_staged_op` (a tensor method looked up on
  its tensor at call time), which registers the storages its outputs own (matched by
  ``untyped_storage().data_ptr()``, with a weak reference that tells a live storage from a
  freed one) under their graph names, keeps a recipe of each op a stage recomputes (the
  callee; its arguments, a graph storage by reference with the argument's geometry,
  anything else detached), and keeps each forward tensor a recomputation reads until then;
* the pack hook saves a tensor (detached: autograd rebuilds the saved variable on unpack)
  where its saver's backward takes the forward instance, else a handle on the recomputed
  instance with the tensor's geometry (a view is rebuilt as that view); tensors an op
  saves while it runs are matched once it has returned (its outputs are packed before),
  its own buffers by the tracer's rule (the ``k``-th storage it packs that is neither an
  input nor an output is ``<op>:buf<k>``), their bytes checked against the graph's;
* a pre-hook on a stage op's autograd node (the ``grad_fn`` of its output) runs the
  stage's recomputations in order, under the forward's autocast state: under ``no_grad``,
  or, for an op that saves buffers of its own (a max-pool's indices, a layer norm's
  statistics), with autograd recording (its inputs requiring gradients as in the forward)
  under a hook that captures what it saves, whose buffers become the recomputed instances
  and whose graph is dropped at once;
  a post-hook on a saver's node ends its use of the instances it unpacked (after the node
  has reduced its gradients, as the op sequence frees them). An instance is dropped after
  its last use, and at once where no use holds it.

A staged step runs one backward pass per forward (``retain_graph=True`` and a second
backward are refused). A stage at an op that returns a tensor of an earlier op
(``getitem`` of a tuple, ``broadcast_tensors`` of equal shapes) has no autograd node of its
own and is refused, naming the op that owns the node. With gradients disabled (``no_grad``,
inference, evaluation) or while compiling, the forward runs as it is, with no hook.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

from chkpt_opt.codegen.outline import HookedBody, outline_forward
from chkpt_opt.codegen.staged_plan import StagedPlan, staged_plan
from chkpt_opt.codegen.staged_run import StagedRun, unpack_staged
from chkpt_opt.codegen.wrapped_call import wrapped_call
from chkpt_opt.errors import ScheduleError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.memory_model.schedule import Schedule

_CALLEE = "_chkpt_staged_callee_"
"""The name prefix of the attributes that hold ops' callees in the staged body."""

_CURRENT: contextvars.ContextVar[StagedRun | None] = contextvars.ContextVar(
    "chkpt_opt_staged_run", default=None
)


def run_staged_op(name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Calls op ``name`` of the staged body: through the running forward's executor where
    one is active, else just calls it."""
    run = _CURRENT.get()
    if run is None:
        return fn(*args, **kwargs)
    return run.call(name, fn, args, kwargs)


@contextlib.contextmanager
def _active(plan: StagedPlan) -> Iterator[None]:
    run = StagedRun(plan)
    token = _CURRENT.set(run)
    try:
        with torch.autograd.graph.saved_tensors_hooks(run.pack, unpack_staged):
            yield
    finally:
        _CURRENT.reset(token)
        run.end_forward()


class _Method:
    """A tensor method, called by name on its first argument."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(tensor, self.name)(*args, **kwargs)


class StagedScope(HookedBody):
    """Runs the forward under a staged schedule's executor (with gradients enabled, not
    while compiling). The body is held outside the module tree."""

    def __init__(self, body: torch.fx.GraphModule, plan: StagedPlan) -> None:
        super().__init__(body)
        self.plan = plan

    def hooks(self) -> contextlib.AbstractContextManager[None]:
        return _active(self.plan)

    def extra_repr(self) -> str:
        steps = self.plan.steps
        return "; ".join(
            f"{b}: {', '.join(steps[j] for j in js)}" for b, js in self.plan.stages.items()
        )


def outline_staged_scope(gm: torch.fx.GraphModule, graph: CostGraph, schedule: Schedule) -> None:
    """Moves the forward of ``gm`` from its first op on into a :class:`StagedScope` whose
    body calls every op of ``graph`` through :func:`run_staged_op` (``gm`` is modified in
    place; the caller recompiles it).

    Raises:
        ScheduleError: an op the schedule names that ``gm``'s forward does not run.
    """
    plan = staged_plan(graph, schedule)
    nodes = list(gm.graph.nodes)
    names = {n.name for n in nodes}
    missing = sorted(({b for b, _ in schedule.staged} | set(plan.steps)) - names)
    if missing:
        raise ScheduleError(
            f"the staged schedule names ops {missing[:3]} that the module's forward does not "
            "run; it was made for another model or another trace of it."
        )
    first = min(i for i, n in enumerate(nodes) if n.name in graph)

    def store(target: Any, name: str) -> str:  # a function's callee, which the body copies
        setattr(gm, f"{_CALLEE}{name}", target)
        return f"{_CALLEE}{name}"

    def copy_node(
        sub: torch.fx.Graph, node: torch.fx.Node, env: dict[torch.fx.Node, torch.fx.Node]
    ) -> torch.fx.Node | None:
        if node.name in graph and node.op == "call_method":
            # looked up at call time: a recipe keeps the tensor as an argument, by reference
            args = tuple(torch.fx.map_arg(node.args, lambda x: env[x]))
            kwargs = dict(torch.fx.map_arg(node.kwargs, lambda x: env[x]))
            callee = sub.get_attr(store(_Method(str(node.target)), node.name))
            call = sub.call_function(run_staged_op, (node.name, callee, *args), kwargs)
            call.meta = dict(node.meta)
            return call
        if node.name in graph:
            return wrapped_call(
                sub, node, env, run_staged_op, lambda t, n=node.name: store(t, n), node.name
            )
        return None

    outline_forward(
        gm,
        first,
        copy_node,
        lambda body: StagedScope(body, plan),
        attribute="chkpt_staged_scope",
        class_name="StagedBody",
    )
