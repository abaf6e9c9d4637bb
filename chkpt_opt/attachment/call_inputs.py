"""The capture rules that ``chkpt_opt.plan``, ``chkpt_opt.trace`` and ``chkpt_opt.optimize``
share: what a training call's inputs are, and whether a plan measures op times.

* **The key/value cache.** A training step never reads a key/value cache, and Hugging Face
  models turn it off under their own checkpointing; a model left at its config's default
  (``use_cache=True``) returns a ``DynamicCache``, which torch.export cannot capture. A
  training call gets ``use_cache=False`` where the model takes it and the call does not
  say (:func:`training_kwargs`). Whether the model takes it is read through wrappers whose
  forward hides it behind ``**kwargs`` (``peft``'s ``PeftModel``, a ``LoraModel``): their
  base model's forward (``get_base_model()``, ``base_model``, ``model``), else a config that
  has a ``use_cache`` setting.
  The module a plan applies (``Plan.apply``, ``chkpt_opt.apply``) takes the call as the
  model does: the keyword values of the capture that are not tensors (``use_cache=False``)
  fill in where a call leaves them out (:func:`with_call_defaults`).
* **Positional inputs**: one tensor, a tuple or list of them, or None (:func:`positional`).
* **Op times** (:func:`measures_times`): measured wherever the model's tensors are real, the
  CPU included (the roofline estimate misjudges small ops: the default plan of a 4-layer
  Llama on the CPU ran 46 regions at 2.22x the original's step time on estimated times, 2
  regions at 1.28x on measured ones); a graph on the meta device is estimated, and so is
  one planned inside a process group (every rank must plan the same schedule).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from chkpt_opt.graphs.costgraph import CostGraph

_BASE_ATTRIBUTES = ("base_model", "model", "module")
"""Where a wrapper that is not ``peft``'s keeps the model it calls (``LoraModel.model``,
DDP's ``module``)."""

_MAX_DEPTH = 8
"""Wrappers followed at most (a guard against modules that name themselves)."""


def positional(example_inputs: Any) -> tuple[Any, ...]:
    """The positional inputs of a call given as one tensor, a tuple or list, or None."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    return tuple(example_inputs or ())


def training_kwargs(
    model: torch.nn.Module,
    kwargs: dict[str, Any] | None,
    forward: Callable[..., Any] | None = None,
) -> dict[str, Any]:
    """The keyword inputs of a training call of ``model`` (whose forward is ``forward``,
    ``model.forward`` by default): ``use_cache=False`` added where the model takes it and
    the call does not say (see the module docstring)."""
    kwargs = dict(kwargs or {})
    if "use_cache" in kwargs or not takes_use_cache(model, forward):
        return kwargs
    return {**kwargs, "use_cache": False}


def takes_use_cache(model: torch.nn.Module, forward: Callable[..., Any] | None = None) -> bool:
    """Whether ``model`` (called through ``forward``) takes a ``use_cache`` keyword: its
    forward names it, or takes ``**kwargs`` and the model it wraps takes it, or takes
    ``**kwargs`` and its config has a ``use_cache`` setting."""
    for _ in range(_MAX_DEPTH):
        parameters = _parameters(forward if forward is not None else model.forward)
        if "use_cache" in parameters:
            return True
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            return False
        base = _wrapped_model(model)
        if base is None:
            config = getattr(model, "config", None)
            return isinstance(getattr(config, "use_cache", None), bool)
        model, forward = base, None
    return False


def with_call_defaults(module: torch.nn.Module, kwargs: dict[str, Any]) -> torch.nn.Module:
    """``module`` (a rewritten capture whose keyword inputs were ``kwargs``), filling in the
    values of ``kwargs`` that are not tensors where a call leaves them out: a model's batch
    without ``use_cache`` runs the capture made with ``use_cache=False``. A forward pre-hook
    run before the capture's own input check; a call that passes another value still fails
    that check."""
    defaults = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    if defaults:
        module.register_forward_pre_hook(CallDefaults(defaults), with_kwargs=True, prepend=True)
    return module


class CallDefaults:
    """The forward pre-hook of :func:`with_call_defaults`."""

    def __init__(self, defaults: dict[str, Any]) -> None:
        self.defaults = defaults

    def __call__(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return args, {**self.defaults, **kwargs}


def measures_times(profile_times: bool | None, graph: CostGraph) -> bool:
    """Whether a plan of ``graph`` measures op times: as asked, else wherever the model's
    tensors are real (see the module docstring), outside a process group: ranks timed
    apart could plan different schedules (under FSDP2 a layer recomputed on one rank and
    not on another gathers its parameters a different number of times), so there the
    estimate, the same on every rank."""
    if profile_times is not None:
        return profile_times
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return False
    return graph.graph.get("device_type") != "meta"


def _parameters(forward: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return {}


def _wrapped_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model a wrapper calls: ``get_base_model()`` (peft), else a ``base_model`` or
    ``model`` submodule; None for a model that wraps nothing."""
    getter = getattr(type(model), "get_base_model", None)
    if callable(getter):
        base = getter(model)
        if isinstance(base, torch.nn.Module) and base is not model:
            return base
    for name in _BASE_ATTRIBUTES:
        base = model._modules.get(name)
        if isinstance(base, torch.nn.Module) and base is not model:
            return base
    return None
