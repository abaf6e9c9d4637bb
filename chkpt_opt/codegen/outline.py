"""A part of the forward outlined into a body that runs under saved-tensor hooks: what the
recompute-on-unpack scope (:mod:`chkpt_opt.codegen.unpack`) and the staged executor
(:mod:`chkpt_opt.codegen.staged`) share.

:func:`outline_forward` moves the forward of a GraphModule from one node on into a body
GraphModule, called by a :class:`HookedBody` whose ``forward`` pushes its hooks (with a
``with``: an error in the forward leaves none behind) while gradients are on and nothing is
compiling, and runs the body as it is otherwise. Each moved node is copied by the caller's
``copy_node`` (a call through the caller's hooks) or as it is.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

CopyNode = Callable[
    [torch.fx.Graph, torch.fx.Node, dict[torch.fx.Node, torch.fx.Node]], "torch.fx.Node | None"
]
"""Copies one node into the body graph through the caller's own call (None: copy it as it is)."""


class HookedBody(torch.nn.Module):
    """Runs an outlined part of the forward under :meth:`hooks` (with gradients enabled).
    The body is held outside the module tree. ``torch.compile`` does not trace it (its
    saved-tensor hooks and backward-node hooks are what dynamo cannot compile): a compiled
    model runs it eagerly, as planned, between its compiled parts."""

    def __init__(self, body: torch.fx.GraphModule) -> None:
        super().__init__()
        object.__setattr__(self, "_body", body)

    @property
    def body(self) -> torch.fx.GraphModule:
        """The outlined part of the forward."""
        return self._body

    def hooks(self) -> contextlib.AbstractContextManager[Any]:
        """The hooks the body runs under (subclasses say which)."""
        raise NotImplementedError

    @torch.compiler.disable
    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return self._body.forward(*args)
        with self.hooks():
            return self._body.forward(*args)


def outline_forward(
    gm: torch.fx.GraphModule,
    first: int,
    copy_node: CopyNode,
    make_scope: Callable[[torch.fx.GraphModule], HookedBody],
    *,
    attribute: str,
    class_name: str,
) -> None:
    """Moves the nodes of ``gm``'s forward from position ``first`` on (placeholders and
    attributes aside) into a body GraphModule named ``class_name``, called through the
    scope ``make_scope(body)`` installed as ``gm.<attribute>``; the values the output reads
    come back as items of the call. ``gm`` is modified in place; the caller recompiles it."""
    nodes = list(gm.graph.nodes)
    output = nodes[-1]
    body_nodes = [n for n in nodes[first:-1] if n.op not in ("placeholder", "get_attr")]
    inside = set(body_nodes)
    ext = list(
        dict.fromkeys(a for node in body_nodes for a in node.all_input_nodes if a not in inside)
    )
    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for arg in ext:
        env[arg] = sub.placeholder(f"in_{arg.name}")
        env[arg].meta = dict(arg.meta)
    for node in body_nodes:
        copied = copy_node(sub, node, env)
        env[node] = copied if copied is not None else sub.node_copy(node, lambda x: env[x])
    returned = [n for n in output.all_input_nodes if n in inside]
    sub.output(tuple(env[n] for n in returned))
    body = torch.fx.GraphModule(gm, sub, class_name=class_name)
    gm.add_submodule(attribute, make_scope(body))
    with gm.graph.inserting_before(output):
        call = gm.graph.call_module(attribute, tuple(ext))
        items = {
            n: gm.graph.call_function(operator.getitem, (call, i)) for i, n in enumerate(returned)
        }
    for node, item in items.items():
        item.meta = dict(node.meta)
    output.args = torch.fx.map_arg(output.args, lambda x: items.get(x, x))
    output.kwargs = torch.fx.map_arg(output.kwargs, lambda x: items.get(x, x))
    for node in reversed(body_nodes):
        gm.graph.erase_node(node)
