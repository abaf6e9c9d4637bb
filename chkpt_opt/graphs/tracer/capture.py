"""Captures a model as an fx GraphModule: torch.export (non-strict, ATen level) first,
``torch.fx.symbolic_trace`` as the fallback.

The captured module shares the model's Parameter and buffer objects; the model itself is
never modified. Each capture can be repeated (:meth:`Captured.fresh_module`), which is how
codegen gets a graph of its own to rewrite.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import _pytree as fx_pytree
from torch.utils import _pytree as pytree

from chkpt_opt.errors import TraceError
from chkpt_opt.graphs.tracer.aliases import describe_path
from chkpt_opt.graphs.tracer.dynamic_dims import (
    InputDims,
    auto_dynamic_shapes,
    exportable,
    input_dims,
)
from chkpt_opt.graphs.tracer.eager_program import eager_branches, resolved_constant_branches

log = logging.getLogger(__name__)

_SCALAR_LEAVES = (bool, int, float, str, type(None), torch.dtype, torch.device)


@dataclass
class Captured:
    """A traced model.

    Attributes:
        module: the GraphModule (parameters shared with the model).
        flat_inputs: the example inputs in placeholder order.
        method: ``"export"`` or ``"fx"``.
        fresh_module: makes another GraphModule with the same node names, sharing the
            same parameters (codegen rewrites that one).
        notes: what happened on the way (e.g. why the fallback was used).
        input_dims: for a capture with symbolic sizes, which input dimensions stayed
            symbolic (:mod:`.dynamic_dims`); None for one of fixed shapes.
    """

    module: torch.fx.GraphModule
    flat_inputs: list[Any]
    method: str
    fresh_module: Callable[[], torch.fx.GraphModule]
    notes: list[str] = field(default_factory=list)
    input_dims: InputDims | None = None


def normalize_inputs(
    example_inputs: Any, example_kwargs: dict[str, Any] | None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Returns ``(args, kwargs)`` after checking that every leaf can be traced.

    A single tensor is accepted as a one-element tuple.

    Raises:
        TraceError: naming the first input that is not a tensor or a plain constant.
    """
    if isinstance(example_inputs, torch.Tensor):
        args: tuple[Any, ...] = (example_inputs,)
    elif isinstance(example_inputs, (tuple, list)):
        args = tuple(example_inputs)
    elif example_inputs is None:
        args = ()
    else:
        raise TraceError(
            f"example_inputs is a {type(example_inputs).__name__}; pass a tuple of the "
            "model's positional inputs, e.g. (torch.randn(8, 3, 224, 224),)."
        )
    kwargs = dict(example_kwargs or {})
    leaves, _ = pytree.tree_flatten_with_path((args, kwargs))
    has_tensor = False
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            has_tensor = True
            continue
        if isinstance(leaf, _SCALAR_LEAVES):
            continue
        where = describe_path(path)
        hint = ""
        if type(leaf).__module__.startswith("numpy"):
            hint = " Convert it with torch.from_numpy(...)."
        raise TraceError(
            f"{where} is a {type(leaf).__module__}.{type(leaf).__name__}, which cannot be "
            f"traced; inputs must be torch tensors (or nested tuples, lists and dicts of "
            f"them, and plain Python constants).{hint}"
        )
    if not has_tensor:
        where = ", ".join(
            f"{describe_path(path)} is a {type(leaf).__name__}" for path, leaf in leaves[:4]
        )
        raise TraceError(
            f"the example inputs contain no tensor ({where or 'they are empty'}); pass at least "
            "one torch.Tensor so the model's activations can be sized."
        )
    return args, kwargs


def capture(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    method: str = "auto",
    dynamic: bool = False,
) -> Captured:
    """Captures ``model`` called on ``(args, kwargs)``.

    Args:
        model: the model (any device, meta included).
        args: positional example inputs.
        kwargs: keyword example inputs.
        method: ``"auto"`` (export, then fx), ``"export"`` or ``"fx"``.
        dynamic: export every tensor dimension the model's code leaves free as symbolic
            (:mod:`.dynamic_dims`); torch.export only (a failure raises, no fallback).

    Raises:
        TraceError: when no method works; the message names the failing construct and what
            to try.
    """
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if method not in ("auto", "export", "fx"):
        raise TraceError(f"tracer method {method!r} is unknown; use 'auto', 'export' or 'fx'.")
    errors: list[str] = []
    if dynamic:
        method = "export"
    if method in ("auto", "export"):
        try:
            try:
                return _capture_export(model, args, kwargs, dynamic)
            except Exception as err:
                if not _register_dataclass_outputs(model, args, kwargs, err):
                    raise
                return _capture_export(model, args, kwargs, dynamic)
        except TraceError:
            raise
        except Exception as err:  # torch.export raises many exception types
            errors.append(f"torch.export failed: {_first_lines(err)}")
            log.info("torch.export failed, trying torch.fx: %s", err)
            if method == "export":
                raise TraceError(_advice(errors)) from err
    try:
        captured = _capture_fx(model, args, kwargs)
    except TraceError as err:  # it says what to do itself
        raise TraceError(" | ".join([*errors, f"torch.fx: {err}"])) from err
    except Exception as err:
        errors.append(f"torch.fx.symbolic_trace failed: {_first_lines(err)}")
        raise TraceError(_advice(errors)) from err
    captured.notes.extend(errors)
    return captured


def _capture_export(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic: bool = False
) -> Captured:
    """Exports the program the model runs eagerly (:mod:`.eager_program`); where that
    program cannot be exported (an op whose fake kernel refuses what its eager kernel
    runs), exports the model's export branch instead and says so in the notes."""
    failures: list[str] = []
    target, shapes = model, None
    if dynamic:
        target = exportable(model, args, kwargs)
        shapes = auto_dynamic_shapes(target, args, kwargs)
    for compiling in (False, True):
        try:
            with (
                eager_branches(compiling=compiling) as replaced,
                resolved_constant_branches() as done,
            ):
                exported = torch.export.export(
                    target, args, kwargs, strict=False, dynamic_shapes=shapes
                )
        except Exception as err:
            if not replaced:  # nothing was patched: retrying would export the same program
                raise
            failures.append(_first_lines(err, limit=1))
            log.info("export with the eager flags (compiling=%s) failed: %s", compiling, err)
            continue
        notes = [f"as eager: {what}" for what in dict.fromkeys(done)]
        if compiling:
            notes.append(
                "captured with Hugging Face's is_torchdynamo_compiling() True (ops the model "
                f"picks when compiled): the eager program failed with {failures[0]}"
            )
        break
    else:
        exported = torch.export.export(target, args, kwargs, strict=False, dynamic_shapes=shapes)
        notes = [
            "captured the model's torch.export branch, which may differ from its eager "
            f"program: the eager one failed with {failures[0]}"
        ]
    _check_outputs(exported)
    module = exported.module()
    flat = list(fx_pytree.tree_flatten_spec((args, kwargs), module._in_spec))
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(flat):
        raise TraceError(
            f"the exported graph takes {len(placeholders)} inputs but the example inputs "
            f"flatten to {len(flat)}; pass inputs as tensors or plain containers of tensors."
        )
    return Captured(
        module=module,
        flat_inputs=flat,
        method="export",
        fresh_module=exported.module,
        notes=notes,
        input_dims=input_dims(exported, module, args, kwargs) if dynamic else None,
    )


def _register_dataclass_outputs(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], err: Exception
) -> bool:
    """Registers the dataclasses a model returns as pytree nodes, if export failed on them.

    Runs the model once on fake tensors to see its outputs. Returns True if it registered a
    class (so that exporting again may succeed).
    """
    text = str(err).lower()
    if "pytree" not in text and "not a known type" not in text:
        return False
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake_args, fake_kwargs = pytree.tree_map_only(
                torch.Tensor, mode.from_tensor, (args, kwargs)
            )
            with torch.no_grad():
                out = model(*fake_args, **fake_kwargs)
    except Exception:
        return False
    registered = False
    stack = [out]
    while stack:
        value = stack.pop()
        kind = type(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            if kind not in pytree.SUPPORTED_NODES:
                torch.export.register_dataclass(
                    kind, serialized_type_name=f"chkpt_opt.{kind.__qualname__}"
                )
                registered = True
            stack.extend(getattr(value, f.name) for f in dataclasses.fields(value))
        elif isinstance(value, (tuple, list)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
    return registered


def _check_outputs(exported: Any) -> None:
    for spec in exported.graph_signature.output_specs:
        if spec.kind.name not in ("USER_OUTPUT", "BUFFER_MUTATION", "USER_INPUT_MUTATION"):
            raise TraceError(
                f"the exported model has an output of kind {spec.kind.name}, which chkpt_opt "
                "does not support."
            )


def _modes() -> tuple[bool, ...]:
    """Grad mode and autocast state: what torch.fx records nothing of."""
    autocast = (torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))
    return (torch.is_grad_enabled(), *autocast)


class _ModeCheckingTracer(torch.fx.Tracer):
    """A symbolic tracer that refuses ops recorded under another grad or autocast mode.

    ``torch.fx`` runs ``with torch.no_grad():`` / ``torch.autocast(...)`` blocks of
    ``forward`` while tracing but records nothing of them, so the traced module would
    compute gradients through a no-grad span, or in float32 where the model computes in
    bfloat16: a silently different model. torch.export keeps such spans; fx cannot.
    """

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> torch.fx.Graph:
        self._start_modes = _modes()
        return super().trace(root, concrete_args)

    def create_node(self, kind: str, target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        node = super().create_node(kind, target, *args, **kwargs)
        if kind not in ("placeholder", "get_attr", "output") and _modes() != self._start_modes:
            grad, *autocast = _modes()
            what = (
                f"grad mode {'enabled' if grad else 'disabled'}"
                if grad != self._start_modes[0]
                else "autocast " + ("enabled" if any(autocast) else "disabled")
            )
            raise TraceError(
                f"op {node.name!r} (target {str(target)[:60]}) runs with {what} inside "
                "forward, which torch.fx cannot record: the traced module would compute other "
                "values or gradients than the model. Trace with torch.export "
                "(tracer='export'), or move the no_grad/autocast block out of forward()."
            )
        return node


def _capture_fx(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Captured:
    def make() -> torch.fx.GraphModule:
        tracer = _ModeCheckingTracer()
        graph = tracer.trace(model)
        return torch.fx.GraphModule(tracer.root, graph, type(model).__name__)

    module = make()
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    flat: list[Any] = []
    for i, node in enumerate(placeholders):
        if i < len(args):
            flat.append(args[i])
        elif node.target in kwargs:
            flat.append(kwargs[node.target])
        elif node.args:
            flat.append(node.args[0])
        else:
            raise TraceError(f"no example value for input {node.target!r} of the fx-traced model.")
    return Captured(module=module, flat_inputs=flat, method="fx", fresh_module=make)


def _first_lines(err: BaseException, limit: int = 3) -> str:
    text = f"{type(err).__name__}: {err}".strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return " ".join(lines[:limit])[:600]


def _advice(errors: list[str]) -> str:
    joined = " | ".join(errors)
    text = f"the model cannot be traced. {joined}."
    lowered = joined.lower()
    if "dynamiccache" in lowered or ("cache" in lowered and "pytree" in lowered):
        text += " The model returns a key/value cache: build it with use_cache=False for training."
    elif "data-dependent" in lowered or "control flow" in lowered or "guard" in lowered:
        text += (
            " A Python branch depends on tensor values: replace it with torch.where or "
            "torch.cond, or move it out of forward()."
        )
    else:
        text += (
            " Make the failing construct traceable (torch.export non-strict runs the Python "
            "code on fake tensors), or trace with tracer='fx' after wrapping it in a leaf module."
        )
    return text
