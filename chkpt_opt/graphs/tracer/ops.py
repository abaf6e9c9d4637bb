"""What kind of op an fx node is: its name, whether it is random, in-place, or stateful.

Shared by the tracer (which records the flags) and codegen (which must replay random ops
with the same numbers and keep stateful ops from updating module state twice).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

# Names (last component, trailing underscore stripped) of random functions and methods
# outside ATen; ATen ops say so themselves with the nondeterministic_seeded tag.
_RANDOM_NAMES = frozenset(
    {
        "dropout",
        "dropout1d",
        "dropout2d",
        "dropout3d",
        "alpha_dropout",
        "feature_alpha_dropout",
        "rand",
        "randn",
        "randint",
        "rand_like",
        "randn_like",
        "randint_like",
        "randperm",
        "bernoulli",
        "normal",
        "multinomial",
        "poisson",
        "uniform",
        "exponential",
        "geometric",
        "cauchy",
        "log_normal",
        "random",
    }
)

# Batch-norm style ops: (indices of running_mean and running_var, of `training`, of `momentum`).
_BATCH_NORM_OPS: dict[str, tuple[tuple[int, int], int, int]] = {
    "aten.batch_norm.default": ((3, 4), 5, 6),
    "aten.instance_norm.default": ((3, 4), 5, 6),
    "aten._native_batch_norm_legit.default": ((3, 4), 5, 6),
    "aten.native_batch_norm.default": ((3, 4), 5, 6),
    "aten._batch_norm_with_update.default": ((3, 4), -1, 5),
    "aten.cudnn_batch_norm.default": ((3, 4), 5, 6),
}


def op_name(node: torch.fx.Node, root: torch.nn.Module | None = None) -> str:
    """A stable, readable name for the op of an fx node.

    ``"aten.linear.default"`` for ATen ops, ``"getitem"`` for tuple indexing,
    ``"module:torch.nn.modules.linear.Linear"`` for fx call_module nodes,
    ``"method:view"`` for call_method nodes, ``"<module>.<qualname>"`` for other functions.
    """
    target = node.target
    if node.op == "call_module":
        module = root.get_submodule(str(target)) if root is not None else None
        kind = type(module) if module is not None else None
        return f"module:{kind.__module__}.{kind.__qualname__}" if kind else f"module:{target}"
    if node.op == "call_method":
        return f"method:{target}"
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    if target is operator.getitem:
        return "getitem"
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
    return f"{module}.{name}" if module else str(name)


def is_random(node: torch.fx.Node, root: torch.nn.Module | None = None) -> bool:
    """Whether the op is a random op: an ATen op with the ``nondeterministic_seeded`` tag
    (attention whatever its dropout probability), a dropout module that drops, or a
    function or method by name. The cost graph records it, and no region caches such an op
    (:func:`~chkpt_opt.memory_model.schedule.cacheable_ops`); attention stays out of caches so,
    since a cached composite attention is predicted above what it holds (on the quickstart's GPT,
    18% above the measured peak). Whether an op really draws at run time, for the replay
    decision, is :func:`may_draw_random`."""
    target = node.target
    if (
        isinstance(target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded in target.tags
    ):
        return True
    if node.op == "call_module" and root is not None:
        module = root.get_submodule(str(target))
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.training:
            return module.p > 0
    if node.op == "call_module":
        return False
    last = op_name(node, root).rsplit(".", 1)[-1].split(":")[-1].rstrip("_")
    return last in _RANDOM_NAMES


def may_draw_random(node: torch.fx.Node, root: torch.nn.Module | None = None) -> bool:
    """Whether the op may draw from the default generators when it runs: an ATen op with
    the ``nondeterministic_seeded`` tag unless its dropout probability is a literal 0
    (attention at ``dropout_p=0``, dropout at ``p=0`` or ``train=False``), a dropout module
    as :func:`is_random` says, and any other op but a function of Python's ``operator``,
    ``builtins`` or ``math`` (a function, method or module of a torch.fx capture may draw
    by any name)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return _aten_draws(node, target, root)
    dropout = torch.nn.modules.dropout._DropoutNd
    if node.op == "call_module" and isinstance(_module(root, target), dropout):
        return is_random(node, root)
    if node.op == "call_function" and callable(target):
        return getattr(target, "__module__", None) not in ("_operator", "builtins", "math")
    return True


def _aten_draws(
    node: torch.fx.Node, target: torch._ops.OpOverload, root: torch.nn.Module | None
) -> bool:
    if torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    # Every argument by its schema name, defaults filled in (None where the call is not
    # bound to the schema: then it may draw).
    normalized = node.normalized_arguments(root, normalize_to_only_use_kwargs=True)
    if normalized is None:
        return True
    named = normalized.kwargs
    if "dropout_p" in named:
        return not _is_zero(named["dropout_p"])
    if target.overloadpacket in (torch.ops.aten.native_dropout, torch.ops.aten.dropout):
        return not (_is_zero(named.get("p")) or named.get("train") is False)
    return True


def _is_zero(value: Any) -> bool:
    return isinstance(value, (int, float)) and value == 0


def _module(root: torch.nn.Module | None, target: Any) -> torch.nn.Module | None:
    return None if root is None else root.get_submodule(str(target))


def mutated_arg_positions(node: torch.fx.Node, root: torch.nn.Module | None = None) -> list[int]:
    """Positional indices of the arguments that the op writes in place.

    From the ATen schema; for fx call_module nodes, modules built with ``inplace=True``
    (``nn.ReLU(inplace=True)``...) write their input; for call_method nodes, methods whose
    name ends with ``_`` write ``self``.
    """
    target = node.target
    if node.op == "call_module":
        module = root.get_submodule(str(target)) if root is not None else None
        return [0] if getattr(module, "inplace", False) is True else []
    if not isinstance(target, torch._ops.OpOverload):
        if (
            node.op == "call_method"
            and str(target).endswith("_")
            and not str(target).endswith("__")
        ):
            return [0]
        return []
    positions = []
    for i, argument in enumerate(target._schema.arguments):
        info = argument.alias_info
        if info is not None and info.is_write and not argument.kwarg_only:
            positions.append(i)
    return positions


def state_arg_positions(node: torch.fx.Node, root: torch.nn.Module | None = None) -> list[int]:
    """Arguments holding module state that the op updates (batch-norm running statistics).

    Returns the positional indices of ``running_mean`` and ``running_var`` when the op is
    a batch-norm in training mode with running statistics, else an empty list.
    """
    spec = _BATCH_NORM_OPS.get(op_name(node, root))
    if spec is None:
        return []
    (mean_i, var_i), training_i, _ = spec
    args = node.args
    if len(args) <= var_i or args[mean_i] is None:
        return []
    if training_i >= 0 and (len(args) <= training_i or args[training_i] is not True):
        return []
    return [mean_i, var_i]


def momentum_position(node: torch.fx.Node, root: torch.nn.Module | None = None) -> int | None:
    """Index of the ``momentum`` argument of a batch-norm op that updates running statistics."""
    if not state_arg_positions(node, root):
        return None
    return _BATCH_NORM_OPS[op_name(node, root)][2]


def is_batch_norm_module(module: Any) -> bool:
    """Whether ``module`` is a batch-norm layer that updates running statistics now."""
    return (
        isinstance(module, torch.nn.modules.batchnorm._NormBase)
        and module.training
        and module.track_running_stats
    )
