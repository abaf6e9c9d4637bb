"""Codegen: rewrites a captured fx graph so that it runs a schedule.

Each recompute region is outlined into a body GraphModule and called through
non-reentrant ``torch.utils.checkpoint``:

* the body takes every value it reads from outside as an argument (parameters and buffers
  included), so it always sees the module's current tensors;
* ``preserve_rng_state=True`` replays the RNG state, so dropout draws the same numbers;
* ops that update module state (batch-norm running statistics, in-place updates of
  buffers such as ``num_batches_tracked``) leave that state alone while the region is
  recomputed (:class:`StateGuard`), so the state is updated exactly once per step;
* a region that reads state (a buffer, or a model input) which an in-place op updates
  later in the step would see the updated value when it is recomputed: it keeps a copy of
  that state as it was when the region ran, and its recomputation runs on a private copy
  of it (:func:`_snapshot_roots`);
* random ops that draw from an explicit ``torch.Generator`` (which checkpoint's
  ``preserve_rng_state`` does not cover) get that generator's state replayed too;
* under ``torch.compile`` the regions are plain non-reentrant checkpoints: AOT autograd
  recomputes them functionally, so module state is updated once without the guards.

The returned module is a new GraphModule; the model passed to ``plan``/``optimize`` is not
modified, and the new module shares its Parameter and buffer objects.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from chkpt_opt.errors import ScheduleError
from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.tracer.ops import (
    is_batch_norm_module,
    momentum_position,
    mutated_arg_positions,
    state_arg_positions,
)
from chkpt_opt.schedule import Schedule, check_schedule

_RECOMPUTING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "chkpt_opt_recomputing", default=False
)


def is_recomputing() -> bool:
    """Whether the current code runs inside the recomputation of a region.

    Always False under ``torch.compile``: there AOT autograd recomputes regions from its
    functionalized graph, which applies module-state updates once, in the forward pass.
    """
    if torch.compiler.is_compiling():
        return False
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

    Values that alias state written in place during the step (a buffer, a model input, or
    the result of an in-place op on them) are *live* values: passed after the activations
    (``n_acts`` of them come first), but to the body directly, not through checkpoint. The
    body takes ``(*activations, *live, *attrs)``. ``snapshot`` lists positions in
    ``(*live, *attrs)`` whose value the recomputation must see as it was when the region
    ran: a copy is taken then, and the recomputation reads it (a private copy of it for
    the positions in ``written``, which the region writes in place).

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
        n_acts: int | None = None,
        snapshot: tuple[int, ...] = (),
        written: tuple[int, ...] = (),
        generators: tuple[torch.Generator, ...] = (),
        for_compile: bool = False,
    ) -> None:
        super().__init__()
        object.__setattr__(self, "_body", body)
        object.__setattr__(self, "_root", root)
        object.__setattr__(self, "_const_generators", generators)
        self.attr_targets = attr_targets
        self.names = names
        self.n_acts = n_acts
        self.snapshot = snapshot
        self.written = written
        self.for_compile = for_compile

    @property
    def body(self) -> torch.fx.GraphModule:
        """The outlined graph of the region."""
        return self._body

    def _attrs(self) -> list[Any]:
        return [_fetch(self._root, t) for t in self.attr_targets]

    def _run(
        self, live: tuple[Any, ...], generator_states: tuple[torch.Tensor, ...], *args: Any
    ) -> Any:
        n = len(args) if self.n_acts is None else self.n_acts
        acts, snapshots = args[:n], args[n:]
        statics = [*live, *self._attrs()]
        if not is_recomputing():
            return self._body(*acts, *statics)
        for position, snapshot in zip(self.snapshot, snapshots):
            # A private copy where the recomputation writes into it (it replays in-place
            # updates of this state), so the saved snapshot stays intact.
            statics[position] = snapshot.clone() if position in self.written else snapshot
        generators = self._generators(statics)
        with _replayed_generators(generators, generator_states):
            return self._body(*acts, *statics)

    def _generators(self, statics: Sequence[Any]) -> list[torch.Generator]:
        found = [v for v in statics if isinstance(v, torch.Generator)]
        return found + [g for g in self._const_generators if all(g is not f for f in found)]

    def forward(self, *args: Any) -> Any:
        n = len(args) if self.n_acts is None else self.n_acts
        acts, live = args[:n], tuple(args[n:])
        if self.for_compile or torch.compiler.is_compiling():
            # torch.compile traces checkpoint into a tagged region that its partitioner
            # recomputes from the functional graph; state updates happen once without
            # guards, snapshots or generator replays (none of which dynamo could trace).
            return checkpoint(
                functools.partial(self._run, live, ()),
                *acts,
                use_reentrant=False,
                preserve_rng_state=True,
            )
        statics = [*live, *self._attrs()]
        snapshots: tuple[torch.Tensor, ...] = ()
        if self.snapshot and torch.is_grad_enabled():
            snapshots = tuple(statics[j].detach().clone() for j in self.snapshot)
        # Checkpoint replays the default generators; explicit ones are replayed here.
        states = tuple(g.get_state() for g in self._generators(statics))
        return checkpoint(
            functools.partial(self._run, live, states),
            *acts,
            *snapshots,
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=_contexts,
        )

    def extra_repr(self) -> str:
        return f"{len(self.names)} ops: {self.names[0]} .. {self.names[-1]}"


@contextlib.contextmanager
def _replayed_generators(
    generators: Sequence[torch.Generator], states: Sequence[torch.Tensor]
) -> Iterator[None]:
    """Sets explicit generators to the states they had in the forward pass, and back."""
    current = [g.get_state() for g in generators]
    for generator, state in zip(generators, states):
        generator.set_state(state)
    try:
        yield
    finally:
        for generator, state in zip(generators, current):
            generator.set_state(state)


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


@dataclass
class _StateInfo:
    """Which values of the main graph alias state that some op writes in place.

    Attributes:
        root: value -> the placeholder or get_attr node whose tensor it is (or a view of).
        last_write: root -> position of the last op that writes it in place.
        position: call node -> its position in execution order.
        hop_writes: call node of a higher-order op -> roots its subgraph writes (such a
            call cannot be guarded, so its region always snapshots them).
    """

    root: dict[torch.fx.Node, torch.fx.Node] = field(default_factory=dict)
    last_write: dict[torch.fx.Node, int] = field(default_factory=dict)
    position: dict[torch.fx.Node, int] = field(default_factory=dict)
    hop_writes: dict[torch.fx.Node, set[torch.fx.Node]] = field(default_factory=dict)

    def written_root(self, value: Any) -> torch.fx.Node | None:
        """The root of ``value`` if some op writes it in place during the step."""
        if not isinstance(value, torch.fx.Node):
            return None
        root = self.root.get(value)
        return root if root in self.last_write else None


def _alias_source(node: torch.fx.Node, gm: torch.nn.Module) -> Any:
    """The argument whose storage the value of ``node`` is (in-place ops, views), or None."""
    if node.op in ("call_method", "call_module"):
        written = mutated_arg_positions(node, gm)
        return node.args[0] if written == [0] and node.args else None
    target = node.target
    if target is operator.getitem and node.args and isinstance(node.args[0], torch.fx.Node):
        inner = node.args[0]  # an item of a list of views (split, unbind, chunk)
        return _alias_source(inner, gm) if inner.op == "call_function" else None
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    returns = target._schema.returns
    if len(returns) != 1 or returns[0].alias_info is None:
        return None
    alias_set = returns[0].alias_info.before_set
    for i, argument in enumerate(target._schema.arguments):
        info = argument.alias_info
        if info is not None and info.before_set & alias_set and i < len(node.args):
            return node.args[i]
    return None


def _hop_subgraph(node: torch.fx.Node, gm: torch.nn.Module) -> tuple[Any, int] | None:
    """For a higher-order op (``wrap_with_set_grad_enabled``, ``wrap_with_autocast``...),
    its subgraph module and the position of its first operand."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return None
    for i, arg in enumerate(node.args):
        if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
            value = _fetch(gm, str(arg.target))
            if isinstance(value, torch.fx.GraphModule):
                return value, i + 1
    return None


def _state_info(gm: torch.fx.GraphModule) -> _StateInfo:
    """Finds the in-place writes to module state and model inputs in ``gm`` (recursively,
    through the subgraphs of higher-order ops)."""
    info = _StateInfo()
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    info.position = {n: i for i, n in enumerate(calls)}
    by_target: dict[str, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":  # torch.fx reads an attribute once per access
            info.root[node] = by_target.setdefault(str(node.target), node)
        elif node.op == "placeholder":
            info.root[node] = node
        elif node.op != "output":
            source = _alias_source(node, gm)
            if isinstance(source, torch.fx.Node) and source in info.root:
                info.root[node] = info.root[source]

    def write(node: torch.fx.Node, value: Any) -> torch.fx.Node | None:
        root = info.root.get(value) if isinstance(value, torch.fx.Node) else None
        if root is not None:
            info.last_write[root] = max(info.last_write.get(root, -1), info.position[node])
        return root

    for node in calls:
        for i in mutated_arg_positions(node, gm) + state_arg_positions(node, gm):
            if i < len(node.args):
                write(node, node.args[i])
        sub = _hop_subgraph(node, gm)
        if sub is None:
            continue
        inner_module, first = sub
        inner = _state_info(inner_module)
        placeholders = [n for n in inner_module.graph.nodes if n.op == "placeholder"]
        for k, placeholder in enumerate(placeholders):
            if placeholder in inner.last_write and first + k < len(node.args):
                root = write(node, node.args[first + k])
                if root is not None:
                    info.hop_writes.setdefault(node, set()).add(root)
    return info


def _snapshot_roots(
    region: list[torch.fx.Node], info: _StateInfo, gm: torch.nn.Module
) -> set[torch.fx.Node]:
    """The written state that a region's recomputation must see as it was in the forward.

    At recompute time (in the backward pass) state holds its value at the end of the
    forward pass. That is what the region saw only if no op writes the state after the
    region's first op that reads it; the guards then keep the recomputation from writing
    it again. Otherwise (a buffer read here and updated later, an update chained over two
    ops, a write inside a higher-order op) the region needs a snapshot.
    """
    inside = set(region)
    first_touch: dict[torch.fx.Node, int] = {}
    forced: set[torch.fx.Node] = set()
    for node in region:
        position = info.position[node]
        # Arguments whose value the recomputation does not need: running statistics that a
        # batch norm updates (its output does not depend on them), and the target of a
        # guarded in-place update whose result nothing in the region reads (the guard
        # skips it; e.g. num_batches_tracked of a batch norm used twice in a step).
        ignored = set(state_arg_positions(node, gm))
        written = mutated_arg_positions(node, gm)
        if (
            len(written) == 1
            and written[0] < len(node.args)
            and node.args[written[0]] not in inside
            and not any(user in inside for user in node.users)
        ):
            ignored.add(written[0])
        items = [(i, a) for i, arg in enumerate(node.args) for a in tree_flatten(arg)[0]]
        items += [(-1, a) for a in tree_flatten(node.kwargs)[0]]
        for i, value in items:
            root = info.written_root(value)
            if root is not None and i not in ignored:
                first_touch[root] = min(first_touch.get(root, position), position)
        forced |= info.hop_writes.get(node, set())
    return {r for r, p in first_touch.items() if info.last_write[r] > p} | forced


def _roots_written_by(
    region: list[torch.fx.Node], info: _StateInfo, gm: torch.nn.Module
) -> set[torch.fx.Node]:
    """The state that ops of the region write in place."""
    roots: set[torch.fx.Node] = set()
    for node in region:
        for i in mutated_arg_positions(node, gm) + state_arg_positions(node, gm):
            root = info.written_root(node.args[i]) if i < len(node.args) else None
            if root is not None:
                roots.add(root)
        roots |= info.hop_writes.get(node, set())
    return roots


def _outline(
    gm: torch.fx.GraphModule,
    region: list[torch.fx.Node],
    k: int,
    info: _StateInfo,
    *,
    for_compile: bool,
) -> None:
    inside = set(region)
    ext: list[torch.fx.Node] = []
    for node in region:
        for arg in node.all_input_nodes:
            if arg not in inside and arg not in ext:
                ext.append(arg)
    attrs = [a for a in ext if a.op == "get_attr"]
    # Values aliasing written state bypass checkpoint's saved inputs: their version
    # changes, and the recomputation must see the right value (see _snapshot_roots).
    live = [a for a in ext if a.op != "get_attr" and info.written_root(a) is not None]
    acts = [a for a in ext if a.op != "get_attr" and a not in live]
    statics = live + attrs
    snap_roots = set() if for_compile else _snapshot_roots(region, info, gm)
    snapshot = tuple(j for j, a in enumerate(statics) if info.written_root(a) in snap_roots)
    written_here = _roots_written_by(region, info, gm)
    written = tuple(j for j in snapshot if info.written_root(statics[j]) in written_here)
    snapped = [info.written_root(statics[j]) for j in snapshot]
    if len(set(snapped)) != len(snapped):
        names = sorted({str(r.target) for r in snapped if r is not None and snapped.count(r) > 1})
        raise ScheduleError(
            f"region {k} ({region[0].name!r}..{region[-1].name!r}) reads {names} through two "
            "aliases, and that state is written in place later in the step: the region "
            "cannot be recomputed safely. Keep these ops out of recompute regions."
        )

    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for j, arg in enumerate(acts + statics):
        placeholder = sub.placeholder(f"in_{arg.name}")
        placeholder.meta = dict(arg.meta)
        static = arg.op in ("get_attr", "placeholder") or arg in live
        # A snapshot is a private copy on recompute: writes into it need no guard.
        placeholder.meta["chkpt_opt_static"] = static and j - len(acts) not in snapshot
        env[arg] = placeholder
    for node in region:
        env[node] = sub.node_copy(node, lambda x: env[x])
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    sub.output(tuple(env[o] for o in outputs))
    body = torch.fx.GraphModule(gm, sub, class_name=f"Region{k}")
    if not for_compile:
        _guard_stateful(body, gm)
    generators = tuple(
        g
        for node in region
        for g in tree_flatten((node.args, node.kwargs))[0]
        if isinstance(g, torch.Generator)
    )

    name = f"chkpt_region_{k}"
    wrapper = CheckpointRegion(
        body,
        gm,
        tuple(str(a.target) for a in attrs),
        tuple(n.name for n in region),
        n_acts=len(acts),
        snapshot=snapshot,
        written=written,
        generators=generators,
        for_compile=for_compile,
    )
    gm.add_submodule(name, wrapper)
    with gm.graph.inserting_before(region[0]):
        call = gm.graph.call_module(name, tuple(acts + live))
        items = [gm.graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    for out, item in zip(outputs, items):
        item.meta = dict(out.meta)
        if out in info.root:  # later regions see the item as the value it stands for
            info.root[item] = info.root[out]
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
    info = _state_info(module)
    for k, names in enumerate(schedule.regions):
        missing = [n for n in names if n not in by_name]
        if missing:
            raise ScheduleError(
                f"region {k} names ops {missing[:3]} that the module does not have; the "
                "schedule was made for another model or another trace of it."
            )
        _outline(module, [by_name[n] for n in names], k, info, for_compile=for_compile)
    module.graph.lint()
    module.recompile()
    return module
