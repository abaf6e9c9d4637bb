"""Codegen's analysis of module state: what a region reads or writes in place.

Finds the values of the captured graph that alias state some op writes in place (buffers,
model inputs, views of them; through the subgraphs of higher-order ops too), decides
which of that state a region's recomputation must see as it was in the forward pass
(a snapshot), and replaces the state-updating ops of a region's body by guards.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_flatten

from chkpt_opt.codegen.runtime import ModuleStateGuard, StateGuard
from chkpt_opt.errors import ScheduleError
from chkpt_opt.fx_attrs import fetch_attr
from chkpt_opt.graphs.tracer.ops import (
    is_batch_norm_module,
    momentum_position,
    mutated_arg_positions,
    state_arg_positions,
)


def guard_stateful(body: torch.fx.GraphModule, root: torch.fx.GraphModule) -> None:
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
class StateInfo:
    """Which values of the main graph alias state that some op writes in place.

    Attributes:
        root: value -> the placeholder or get_attr node whose tensor it is (or a view of).
        last_write: root -> position of the last op that writes it in place.
        position: call node -> its position in execution order.
        hop_writes: call node of a higher-order op -> roots its subgraph writes (such a
            call cannot be guarded, so its region always snapshots them).
        in_place: roots some op writes in place (not only as a batch norm's running
            statistics, which a recomputation leaves unchanged).
    """

    root: dict[torch.fx.Node, torch.fx.Node] = field(default_factory=dict)
    last_write: dict[torch.fx.Node, int] = field(default_factory=dict)
    position: dict[torch.fx.Node, int] = field(default_factory=dict)
    hop_writes: dict[torch.fx.Node, set[torch.fx.Node]] = field(default_factory=dict)
    in_place: set[torch.fx.Node] = field(default_factory=set)

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
            value = fetch_attr(gm, str(arg.target))
            if isinstance(value, torch.fx.GraphModule):
                return value, i + 1
    return None


def state_info(gm: torch.fx.GraphModule) -> StateInfo:
    """Finds the in-place writes to module state and model inputs in ``gm`` (recursively,
    through the subgraphs of higher-order ops)."""
    info = StateInfo()
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
        mutated = mutated_arg_positions(node, gm)
        for i in mutated + state_arg_positions(node, gm):
            if i < len(node.args):
                root = write(node, node.args[i])
                if root is not None and i in mutated:
                    info.in_place.add(root)
        sub = _hop_subgraph(node, gm)
        if sub is None:
            continue
        inner_module, first = sub
        inner = state_info(inner_module)
        placeholders = [n for n in inner_module.graph.nodes if n.op == "placeholder"]
        for k, placeholder in enumerate(placeholders):
            if placeholder in inner.last_write and first + k < len(node.args):
                root = write(node, node.args[first + k])
                if root is not None:
                    info.hop_writes.setdefault(node, set()).add(root)
                    info.in_place.add(root)
    return info


def snapshot_roots(
    region: list[torch.fx.Node], info: StateInfo, gm: torch.nn.Module
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


def roots_written_by(
    region: list[torch.fx.Node], info: StateInfo, gm: torch.nn.Module, *, stats: bool = True
) -> set[torch.fx.Node]:
    """The state that ops of the region write in place (with ``stats=False``, not counting
    the running statistics that batch norms update: a recomputation leaves them as they
    are, momentum 0)."""
    roots: set[torch.fx.Node] = set()
    for node in region:
        stat_positions = state_arg_positions(node, gm) if stats else []
        for i in mutated_arg_positions(node, gm) + stat_positions:
            root = info.written_root(node.args[i]) if i < len(node.args) else None
            if root is not None:
                roots.add(root)
        roots |= info.hop_writes.get(node, set())
    return roots
