"""Captures whose tensor dimensions stay symbolic, so one graph serves many shapes.

A symbolic capture may run another program than the model runs eagerly at fixed shapes:
code that tests sizes or values the capture cannot resolve takes its general branch (a
Hugging Face Llama without ``attention_mask`` builds an explicit causal mask instead of
calling attention with ``is_causal``, and its gradients differ in the last bits).
:func:`program_ops` lists what a capture computes, so a caller can keep a symbolic
capture only where it computes what the fixed-shape one does.

torch.export with ``Dim.AUTO`` on every dimension of every tensor input keeps each size
symbolic unless the model's code pins it (a view to a fixed width, a guard): then that
dimension is exported static. :class:`InputDims` records, per input, which dimensions
stayed symbolic, their ranges, and the sizes of the example they were captured on, so
a caller can tell whether another call's shapes can run the same graph and are no larger
than the example (where the cost graph, built on the example, bounds their memory: every
tensor's size grows with the sizes it is made of).
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

DimSpec = int | str
"""A dimension of a captured input: its size where it is static, else its symbol."""


@dataclass(frozen=True)
class InputDims:
    """The dimensions of a capture's tensor inputs.

    Attributes:
        dims: per input path (``input_ids``, ``args[0]``), each dimension's static size or
            symbol.
        ranges: per symbol, the smallest and largest size the graph is valid for.
        example: per symbol, its size in the example the graph was captured on.
    """

    dims: dict[str, tuple[DimSpec, ...]]
    ranges: dict[str, tuple[int, int | None]]
    example: dict[str, int]

    @property
    def symbolic(self) -> bool:
        """Whether any dimension stayed symbolic."""
        return bool(self.example)

    def admits(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        """Whether tensors of ``shapes`` (by input path) can run the graph at no more than
        the example's sizes: static sizes equal, each symbol's sizes alike, within its
        range and at most its example size."""
        if shapes.keys() != self.dims.keys():
            return False
        seen: dict[str, int] = {}
        for path, shape in shapes.items():
            spec = self.dims[path]
            if len(shape) != len(spec):
                return False
            for size, dim in zip(shape, spec):
                if isinstance(dim, int):
                    if size != dim:
                        return False
                    continue
                if seen.setdefault(dim, size) != size:
                    return False
                low, high = self.ranges[dim]
                if size < low or size > self.example[dim] or (high is not None and size > high):
                    return False
        return True


def leaf_path(path: tuple[Any, ...]) -> str:
    """``args[0]`` / ``attention_mask`` / ``labels['x']`` from a pytree path of
    ``(args, kwargs)``: the name a call key gives an input."""
    head, *rest = path
    if getattr(head, "idx", None) == 0:
        return "args" + "".join(str(k) for k in rest)
    first, *more = rest
    return str(getattr(first, "key", first)) + "".join(str(k) for k in more)


def exportable(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.nn.Module:
    """``model``, or a module around it whose forward names the call's inputs explicitly
    where the call passes keywords through the model's ``**kwargs``: torch.export with
    dynamic shapes refuses keyword inputs caught by a var-keyword parameter (it matches
    the shapes against the signature's names; in torch 2.13 that fails with "Must provide
    a tree_name when there might be a mismatch")."""
    parameters = inspect.signature(model.forward).parameters.values()
    named = {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    if all(name in named for name in kwargs):
        return model
    positional = [
        p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    names = [positional[i] if i < len(positional) else f"arg{i}" for i in range(len(args))]
    return _NamedInputs(model, names, list(kwargs))


class _NamedInputs(torch.nn.Module):
    """Calls ``model`` through a forward whose signature names the inputs of one call."""

    def __init__(self, model: torch.nn.Module, positional: list[str], keywords: list[str]):
        super().__init__()
        self.model = model
        kind = inspect.Parameter
        stated = inspect.Signature(
            [
                kind("self", kind.POSITIONAL_ONLY),
                *(kind(name, kind.POSITIONAL_ONLY) for name in positional),
                *(kind(name, kind.KEYWORD_ONLY) for name in keywords),
            ]
        )

        def forward(self: _NamedInputs, *args: Any, **kwargs: Any) -> Any:
            return self.model(*args, **kwargs)

        forward.__signature__ = stated  # type: ignore[attr-defined]
        self.forward = types.MethodType(forward, self)  # type: ignore[method-assign]


def auto_dynamic_shapes(
    target: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``dynamic_shapes`` for torch.export: ``Dim.AUTO`` on every dimension of every tensor
    input (scalars and constants static)."""
    shapes = torch.export.ShapesCollection()
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim():
            shapes[leaf] = dict.fromkeys(range(leaf.dim()), torch.export.Dim.AUTO)
    return shapes.dynamic_shapes(target, args, kwargs)


def input_dims(
    exported: Any, module: torch.fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> InputDims:
    """Reads which dimensions of the inputs stayed symbolic in ``exported`` (whose module
    ``module`` takes ``(args, kwargs)`` in the order they flatten)."""
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    flat = pytree.tree_flatten_with_path((args, kwargs))[0]
    ranges = {
        str(symbol): (_bound(r.lower) or 0, _bound(r.upper))
        for symbol, r in exported.range_constraints.items()
    }
    dims: dict[str, tuple[DimSpec, ...]] = {}
    example: dict[str, int] = {}
    for (path, value), node in zip(flat, placeholders):
        if not isinstance(value, torch.Tensor):
            continue
        fake = node.meta.get("val")
        spec: list[DimSpec] = []
        for size, traced in zip(value.shape, getattr(fake, "shape", value.shape)):
            symbol = str(traced.node.expr) if isinstance(traced, torch.SymInt) else None
            if symbol is None or symbol not in ranges:
                spec.append(int(size))
            else:
                spec.append(symbol)
                example[symbol] = int(size)
        dims[leaf_path(path)] = tuple(spec)
    return InputDims(dims=dims, ranges=ranges, example=example)


_SIZE_OPS = ("sym_size", "sym_constrain", "_assert", "sym_numel", "sym_stride")
"""Size arithmetic and checks, which a symbolic capture adds."""

_VIEW_OPS = frozenset(
    f"aten.{name}"
    for name in (
        "slice.Tensor",
        "alias.default",
        "view.default",
        "_unsafe_view.default",
        "reshape.default",
        "expand.default",
        "unsqueeze.default",
        "squeeze.dim",
        "squeeze.default",
        "select.int",
        "permute.default",
        "transpose.int",
        "t.default",
        "contiguous.default",
    )
)
"""Ops that change no value (a slice of the whole range, elided at fixed shapes)."""


def program_ops(module: torch.fx.GraphModule) -> list[str]:
    """The value-computing ops a captured module runs, in order: what its program
    computes, without views and without the size arithmetic and checks of a symbolic
    capture (a fixed-shape capture elides the slices that take a whole dimension)."""
    return [
        str(node.target)
        for node in module.graph.nodes
        if node.op == "call_function"
        and "aten" in str(node.target)
        and str(node.target) not in _VIEW_OPS
        and not any(part in str(node.target) for part in _SIZE_OPS)
    ]


def _bound(value: Any) -> int | None:
    """A range end as an int; None where it is infinite."""
    try:
        return int(value)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None
