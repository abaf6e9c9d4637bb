"""Probes of ops the build has probed before: a model of 32 identical layers runs each
layer's ops 32 times on the same layouts, and a probe (:func:`~.probe.probe_op`) is a pure
function of what it is given, so each distinct op is probed once.

The key is everything :func:`~.probe.probe_op` reads: the op (an ATen ``OpOverload``; any
other callable is probed every time), the layout, dtype and device of each tensor input
(the probe runs on fresh inputs of that layout), the value of every other input (only
plain values: numbers, strings, dtypes, devices, symbolic sizes by their expression), the
structure of the arguments, and for each tensor input its :class:`~.probe.LeafInfo`, with
the parameter reduced to which input position first names it and whether its gradient is
created here first; the grad mode and which outputs receive gradients. A hit returns a copy
of the first probe's result with its parameter gradients renamed position by position.
Measured on a 32-layer Llama of width 256: 2,087 probes, 8.5 s, at one capture; see
``benchmarks/results/plan_cost.md``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from chkpt_opt.graphs.tracer.probe import LeafInfo, ProbeResult, probe_op

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout)
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _leaf_key(leaf: Any) -> tuple[object, ...] | None:
    """What the probe reads of one argument leaf; None where it cannot be keyed."""
    if isinstance(leaf, torch.Tensor):
        return (
            "tensor",
            str(tuple(leaf.shape)),
            str(tuple(leaf.stride())),
            str(leaf.storage_offset()),
            leaf.dtype,
            leaf.device.type,
        )
    if isinstance(leaf, _SYMBOLIC):
        return (type(leaf).__name__, str(leaf))
    if isinstance(leaf, (*_PLAIN, torch.memory_format)):
        return (type(leaf).__name__, repr(leaf))
    return None


def probe_key(
    fn: Callable[..., Any],
    args: Any,
    kwargs: dict[str, Any],
    infos: Sequence[LeafInfo],
    grad_enabled: bool,
    grad_outputs: Sequence[bool] | None,
    first_param_grads: set[str],
) -> tuple[object, ...] | None:
    """The memo key of a probe (see the module docstring); None: probe it every time."""
    if not isinstance(fn, torch._ops.OpOverload):
        return None
    leaves, spec = tree_flatten((args, kwargs))
    keys = [_leaf_key(leaf) for leaf in leaves]
    if any(k is None for k in keys):
        return None
    names = [info.param for info in infos]
    params = tuple(
        (
            info.requires_grad,
            info.inplace_target,
            None if info.param is None else names.index(info.param),
            info.param in first_param_grads,
        )
        for info in infos
    )
    outputs = None if grad_outputs is None else tuple(bool(g) for g in grad_outputs)
    return (fn, str(spec), tuple(keys), params, grad_enabled, outputs)


class ProbeMemo:
    """:func:`~.probe.probe_op` with the results of the ops probed before reused."""

    def __init__(self) -> None:
        # key -> (the first probe's result, the parameter name at each tensor input)
        self._results: dict[tuple[object, ...], tuple[ProbeResult, list[str | None]]] = {}
        self.probes = 0
        self.hits = 0

    def probe(
        self,
        fn: Callable[..., Any],
        args: Any,
        kwargs: dict[str, Any],
        infos: Sequence[LeafInfo],
        *,
        grad_enabled: bool,
        grad_outputs: Sequence[bool] | None,
        first_param_grads: set[str],
    ) -> ProbeResult:
        """The probe of this op (:func:`~.probe.probe_op`'s arguments)."""
        key = probe_key(fn, args, kwargs, infos, grad_enabled, grad_outputs, first_param_grads)
        names = [info.param for info in infos]
        hit = None if key is None else self._results.get(key)
        if hit is None:
            self.probes += 1
            result = probe_op(
                fn,
                args,
                kwargs,
                infos,
                grad_enabled=grad_enabled,
                grad_outputs=grad_outputs,
                first_param_grads=first_param_grads,
            )
            if key is not None:
                self._results[key] = (copy.deepcopy(result), names)
            return result
        self.hits += 1
        first, first_names = hit
        result = copy.deepcopy(first)
        renamed = {old: new for old, new in zip(first_names, names) if old is not None}
        result.param_grads = {renamed[p]: b for p, b in first.param_grads.items()}
        return result
