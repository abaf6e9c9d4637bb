"""Which recompute regions draw from the default random generators.

Checkpoint's ``preserve_rng_state=True`` copies the default generators' state when a region
runs forward (``torch.get_rng_state()``: 5056 bytes on CPU, kept until the region's
backward) and restores it around the recomputation, so that dropout draws the same
numbers twice. A region whose ops draw no random numbers needs neither the copy nor the
restore; Hugging Face's checkpointing pays both for every layer. Codegen asks for the
replay only where :func:`draws_random` says a region may draw.

The test is conservative: an ATen op tagged ``nondeterministic_seeded`` draws unless its
dropout probability is a literal 0 (attention at ``dropout_p=0``, dropout at ``p=0`` or
``train=False``); an op that is not an ATen op (a module, method or Python function of a
torch.fx capture, an autocast block) is assumed to draw, except Python's ``operator``,
``builtins`` and ``math`` functions.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.fx

from chkpt_opt.codegen.runtime import CheckpointRegion

_UNSET = object()
_PLAIN_MODULES = ("_operator", "builtins", "math")  # Python functions that draw nothing


def _argument(node: torch.fx.Node, schema: torch.FunctionSchema, name: str) -> Any:
    """The value ``node`` passes for the schema argument ``name`` (its default if none)."""
    for index, argument in enumerate(schema.arguments):
        if argument.name != name:
            continue
        if name in node.kwargs:
            return node.kwargs[name]
        if not argument.kwarg_only and index < len(node.args):
            return node.args[index]
        return argument.default_value if argument.has_default_value() else _UNSET
    return _UNSET


def _op_draws(node: torch.fx.Node) -> bool:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        if torch.Tag.nondeterministic_seeded not in target.tags:
            return False
        schema = target._schema
        dropout_p = _argument(node, schema, "dropout_p")
        if dropout_p is not _UNSET:
            return not (isinstance(dropout_p, (int, float)) and dropout_p == 0)
        if target.overloadpacket in (torch.ops.aten.native_dropout, torch.ops.aten.dropout):
            p, train = _argument(node, schema, "p"), _argument(node, schema, "train")
            return not ((isinstance(p, (int, float)) and p == 0) or train is False)
        return True
    return not (callable(target) and getattr(target, "__module__", None) in _PLAIN_MODULES)


def draws_random(nodes: Iterable[torch.fx.Node], module: torch.fx.GraphModule) -> bool:
    """Whether a region of these call nodes of ``module`` may draw from the default
    generators. A region nested in it (a call of a :class:`CheckpointRegion`) counts with
    its own answer, :attr:`CheckpointRegion.replays_rng`: recomputing the outer region runs
    it forward again."""
    for node in nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if node.op == "call_module":
            called = module.get_submodule(str(node.target))
            if not isinstance(called, CheckpointRegion) or called.replays_rng:
                return True
        elif node.op != "call_function" or _op_draws(node):
            return True
    return False
