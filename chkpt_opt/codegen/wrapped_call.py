"""An fx node copied into another graph as a call of a wrapper that takes its callee as a
value: what codegen does for a cached op on the compile path
(``run_cached_for_compile``) and for an unpacked op (``run_unpacked``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx


def wrapped_call(
    into: torch.fx.Graph,
    node: torch.fx.Node,
    env: dict[torch.fx.Node, Any],
    wrapper: Callable[..., Any],
    store_callee: Callable[[Any], str],
    *lead: Any,
) -> torch.fx.Node:
    """``node`` copied into ``into`` as ``wrapper(*lead, callee, *args, **kwargs)``, its
    arguments mapped through ``env``. The callee of a method is fetched from its first
    argument, that of a module is the module's attribute; a function, which fx code cannot
    name inline, is handed to ``store_callee``, which makes it an attribute and returns its
    name. The copy keeps the node's meta."""
    args = tuple(torch.fx.map_arg(node.args, lambda x: env[x]))
    kwargs = dict(torch.fx.map_arg(node.kwargs, lambda x: env[x]))
    if node.op == "call_method":
        callee = into.call_function(getattr, (args[0], node.target))
        args = args[1:]
    elif node.op == "call_module":
        callee = into.get_attr(str(node.target))
    else:
        callee = into.get_attr(store_callee(node.target))
    call = into.call_function(wrapper, (*lead, callee, *args), kwargs)
    call.meta = dict(node.meta)
    return call
