"""Codegen: rewrites a captured fx graph so that it runs a schedule.

Each recompute region is outlined into a body GraphModule and called through
non-reentrant ``torch.utils.checkpoint``:

* the body takes every value it reads from outside as an argument (parameters and buffers
  included), so it always sees the module's current tensors;
* ``preserve_rng_state=True`` replays the RNG state, so dropout draws the same numbers;
* ops that update module state (batch-norm running statistics, in-place updates of
  buffers such as ``num_batches_tracked``) leave that state alone while the region is
  recomputed (:class:`StateGuard`), so the state is updated exactly once per step.

The returned module is a new GraphModule; the model passed to ``plan``/``optimize`` is not
modified, and the new module shares its Parameter and buffer objects.
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
from torch.utils.checkpoint import checkpoint

from chkpt_opt.errors import ScheduleError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.tracer.ops import (
    is_batch_norm_module,
    momentum_position,
    mutated_arg_positions,
)
from chkpt_opt.schedule import Schedule, check_schedule

_RECOMPUTING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "chkpt_opt_recomputing", default=False
)


def is_recomputing() -> bool:
    """Whether the current code runs inside the recomputation of a region."""
    return _RECOMPUTING.get()


@contextlib.contextmanager
def _recompute_flag() -> Iterator[None]:
    token = _RECOMPUTING.set(True)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)


def _contexts() -> tuple[
    contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]
]:
    return contextlib.nullcontext(), _recompute_flag()


class StateGuard(torch.nn.Module):
    """Runs a state-updating op normally, and without changing the state while recomputing.

    ``mode="momentum"``: a batch-norm op in training mode; on recompute its momentum is set
    to 0, so the running statistics are updated to exactly themselves (the output depends
    only on the batch statistics, and autograd saves the same tensors as in the forward
    pass). ``mode="skip"``: an in-place update of a buffer (``num_batches_tracked += 1``);
    on recompute it is skipped and the buffer returned. ``mode="copy"``: any other in-place
    write to module state; on recompute it writes into a copy.
    """

    def __init__(self, op: Any, position: int, mode: str) -> None:
        super().__init__()
        self.op = op
        self.position = position
        self.mode = mode

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not is_recomputing():
            return self.op(*args, **kwargs)
        if self.mode == "skip":
            return args[self.position]
        values = list(args)
        if self.mode == "momentum":
            values[self.position] = 0.0
        else:
            values[self.position] = values[self.position].clone()
        return self.op(*values, **kwargs)


class ModuleStateGuard(torch.nn.Module):
    """Calls a batch-norm module; while recomputing, calls ``F.batch_norm`` with momentum 0
    (running statistics unchanged, ``num_batches_tracked`` not incremented)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_target", module)  # not a child: no duplicate state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        module = self._target
        if not is_recomputing():
            return module(x)
        return torch.nn.functional.batch_norm(
            x,
            module.running_mean,
            module.running_var,
            module.weight,
            module.bias,
            True,
            0.0,
            module.eps,
        )


class CheckpointRegion(torch.nn.Module):
    """Calls an outlined region through non-reentrant checkpoint.

    Activations reach the body as checkpoint arguments (checkpoint keeps them for the
    recomputation). Parameters and buffers are read from the root module at call time,
    inside the checkpointed function: they are not saved by checkpoint (an in-place buffer
    update would otherwise fail its version check on recompute), and the body always sees
    the module's current tensors, also after ``.to()``.

    The body and the root are held outside the module tree, so the optimized module has
    exactly the parameters, buffers and state_dict keys of the model.
    """

    def __init__(
        self,
        body: torch.fx.GraphModule,
        root: torch.nn.Module,
        attr_targets: tuple[str, ...],
        names: tuple[str, ...],
        *,
        for_compile: bool = False,
    ) -> None:
        super().__init__()
        object.__setattr__(self, "_body", body)
        object.__setattr__(self, "_root", root)
        self.attr_targets = attr_targets
        self.names = names
        self.for_compile = for_compile

    @property
    def body(self) -> torch.fx.GraphModule:
        """The outlined graph of the region."""
        return self._body

    def _run(self, *args: Any) -> Any:
        attrs = [_fetch(self._root, t) for t in self.attr_targets]
        return self._body(*args, *attrs)

    def forward(self, *args: Any) -> Any:
        if self.for_compile:
            # torch.compile traces checkpoint into a tagged region that its partitioner
            # recomputes; state updates are functionalized and happen once without guards.
            return checkpoint(self._run, *args, use_reentrant=False)
        return checkpoint(
            self._run,
            *args,
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=_contexts,
        )

    def extra_repr(self) -> str:
        return f"{len(self.names)} ops: {self.names[0]} .. {self.names[-1]}"


def _fetch(root: torch.nn.Module, target: str) -> Any:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _guard_stateful(body: torch.fx.GraphModule, root: torch.fx.GraphModule) -> None:
    """Replaces state-updating ops of a body graph by guarded calls."""
    count = 0
    for node in list(body.graph.nodes):
        guard: torch.nn.Module | None = None
        if node.op == "call_function":
            momentum = momentum_position(node, root)
            written = [
                i
                for i in mutated_arg_positions(node)
                if i < len(node.args)
                and isinstance(node.args[i], torch.fx.Node)
                and node.args[i].meta.get("chkpt_opt_static", False)
            ]
            if momentum is not None:
                if len(node.args) <= momentum:
                    raise ScheduleError(f"batch-norm node {node.name!r} has no momentum argument.")
                guard = StateGuard(node.target, momentum, "momentum")
            elif written == [0]:
                guard = StateGuard(node.target, 0, "skip")
            elif len(written) == 1:
                guard = StateGuard(node.target, written[0], "copy")
            elif written:
                raise ScheduleError(
                    f"op {node.name!r} writes several module buffers in place; it cannot be "
                    "recomputed safely. Keep it out of recompute regions."
                )
        elif node.op == "call_module":
            module = root.get_submodule(str(node.target))
            if is_batch_norm_module(module):
                guard = ModuleStateGuard(module)
        if guard is None:
            continue
        name = f"state_guard_{count}"
        count += 1
        body.add_submodule(name, guard)
        with body.graph.inserting_before(node):
            new = body.graph.call_module(name, node.args, node.kwargs)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        body.graph.erase_node(node)
    if count:
        body.recompile()


def _outline(
    gm: torch.fx.GraphModule, region: list[torch.fx.Node], k: int, *, for_compile: bool
) -> None:
    inside = set(region)
    ext: list[torch.fx.Node] = []
    for node in region:
        for arg in node.all_input_nodes:
            if arg not in inside and arg not in ext:
                ext.append(arg)
    acts = [a for a in ext if a.op != "get_attr"]
    attrs = [a for a in ext if a.op == "get_attr"]
    outputs = [n for n in region if any(u not in inside for u in n.users)]

    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for arg in acts + attrs:
        placeholder = sub.placeholder(f"in_{arg.name}")
        placeholder.meta = dict(arg.meta)
        placeholder.meta["chkpt_opt_static"] = arg.op in ("get_attr", "placeholder")
        env[arg] = placeholder
    for node in region:
        env[node] = sub.node_copy(node, lambda x: env[x])
    sub.output(tuple(env[o] for o in outputs))
    body = torch.fx.GraphModule(gm, sub, class_name=f"Region{k}")
    if not for_compile:
        _guard_stateful(body, gm)

    name = f"chkpt_region_{k}"
    wrapper = CheckpointRegion(
        body,
        gm,
        tuple(str(a.target) for a in attrs),
        tuple(n.name for n in region),
        for_compile=for_compile,
    )
    gm.add_submodule(name, wrapper)
    with gm.graph.inserting_before(region[0]):
        call = gm.graph.call_module(name, tuple(acts))
        items = [gm.graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    for out, item in zip(outputs, items):
        item.meta = dict(out.meta)
        out.replace_all_uses_with(item)
    for node in reversed(region):
        gm.graph.erase_node(node)


def apply_schedule(
    module: torch.fx.GraphModule, graph: CostGraph, schedule: Schedule, *, for_compile: bool = False
) -> torch.fx.GraphModule:
    """Rewrites ``module`` (a fresh capture, modified in place) to run ``schedule``.

    Args:
        module: a GraphModule whose call nodes are the nodes of ``graph``.
        graph: the cost graph of that module.
        schedule: a valid schedule of ``graph``.
        for_compile: emit regions for ``torch.compile`` (plain non-reentrant checkpoint,
            which dynamo turns into regions its partitioner recomputes; no eager guards).

    Returns:
        ``module``, rewritten and recompiled.
    """
    check_schedule(graph, schedule)
    by_name = {n.name: n for n in module.graph.nodes}
    for k, names in enumerate(schedule.regions):
        missing = [n for n in names if n not in by_name]
        if missing:
            raise ScheduleError(
                f"region {k} names ops {missing[:3]} that the module does not have; the "
                "schedule was made for another model or another trace of it."
            )
        _outline(module, [by_name[n] for n in names], k, for_compile=for_compile)
    module.graph.lint()
    module.recompile()
    return module
