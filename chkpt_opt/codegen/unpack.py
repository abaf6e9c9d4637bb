"""Codegen of recompute on unpack (:mod:`chkpt_opt.memory_model.unpack`): saved-tensor hooks that
save a recipe instead of an unpacked op's output, and the rewrite that installs them.

The rewrite (:func:`outline_unpack_scope`) moves the forward from the first unpacked op to
its end into a body GraphModule called by an :class:`UnpackScope`, which runs it under
``torch.autograd.graph.saved_tensors_hooks`` (pushed and popped by a ``with``, so an
exception in the forward leaves no hook behind). Inside the body:

* each unpacked op runs through :func:`run_unpacked`: its call with strong references to
  its arguments is a :class:`Recipe` (an argument that an earlier unpacked op returned is
  kept as a handle on that op's recipe, rebuilt first), and each tensor it returns is
  registered by its storage (a weak reference to the storage; the registry holds the
  recipes to the end of the forward);
* the pack hook matches a saved tensor to a registered output by its untyped storage (the
  storage alive and at the same address) and returns a handle to the recipe with the
  tensor's geometry (offset, size, stride, dtype): a view of the output is rebuilt as that
  view. Anything else is saved as it is. Tensors the unpacked op itself saves while it runs
  are matched once it has returned (its outputs are packed before the call returns);
* the unpack hook rebuilds the outputs once (under ``no_grad`` and the forward's autocast
  state, from the same inputs, as the forward computed them) and keeps each rebuilt
  output until every handle on it has been unpacked; with ``retain_graph`` a later unpack
  rebuilds it again;
* recompute regions push their own checkpoint hooks, which take precedence inside them;
  the call of a region itself saves its inputs (checkpoint's frame) plainly
  (:func:`call_keeping_inputs`), so a region keeps its inputs as the op sequence says.

With gradients disabled (``torch.no_grad()``, evaluation) nothing is pushed or registered:
the body runs as it is. The compiled path does not run unpacked ops (``rewrite_module``
refuses them there).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_map

from chkpt_opt.codegen.outline import HookedBody, outline_forward
from chkpt_opt.codegen.runtime import CheckpointRegion
from chkpt_opt.codegen.wrapped_call import wrapped_call
from chkpt_opt.errors import ScheduleError

_CALLEE = "_chkpt_unpacked_callee_"
"""The name prefix of the attributes that hold unpacked ops' callees in the scope body."""


class Recipe:
    """One call of an unpacked op: the callee with its arguments (strong references), the
    outputs it rebuilt and how many saved handles of each output are still packed."""

    __slots__ = ("args", "autocast", "counts", "fn", "kwargs", "rebuilt")

    def __init__(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.counts: dict[int, int] = {}
        self.rebuilt: dict[int, torch.Tensor] = {}
        # the autocast state of the forward (the backward runs without it), per device type
        devices = {t.device.type for t in _tensors((args, kwargs))} | {"cpu"}
        self.autocast = [
            (d, torch.get_autocast_dtype(d), torch.is_autocast_enabled(d))
            for d in sorted(devices)
            if torch.amp.is_autocast_available(d)
        ]

    def output(self, index: int) -> torch.Tensor:
        """The ``index``-th tensor the op returns: the rebuilt one, rebuilt where none is
        held (then the outputs that handles still need are held, the others dropped)."""
        held = self.rebuilt.get(index)
        if held is not None:
            return held
        # Handles on earlier unpacked ops' outputs are unpacked (rebuilt) first.
        args, kwargs = tree_map(_unpacked, (self.args, self.kwargs))
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            for device, dtype, enabled in self.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            flat = _tensors(self.fn(*args, **kwargs))
        self.rebuilt = {i: flat[i] for i, count in self.counts.items() if count > 0}
        return flat[index]

    def unpacked(self, index: int) -> None:
        """One handle on output ``index`` was unpacked: the last one drops the rebuild."""
        self.counts[index] -= 1
        if self.counts[index] <= 0:
            self.rebuilt.pop(index, None)


class Packed:
    """A saved tensor as the pack hook keeps it: the tensor itself until it is matched to
    an output of a recipe, then the recipe, the output's index and the tensor's geometry."""

    __slots__ = ("dtype", "index", "offset", "recipe", "size", "stride", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.recipe: Recipe | None = None
        self.index = -1
        self.offset = tensor.storage_offset()
        self.size = tuple(tensor.shape)
        self.stride = tuple(tensor.stride())
        self.dtype = tensor.dtype

    def bind(self, recipe: Recipe, index: int) -> None:
        """Keeps the recipe instead of the tensor."""
        self.recipe, self.index, self.tensor = recipe, index, None
        recipe.counts[index] = recipe.counts.get(index, 0) + 1

    def unpack(self) -> torch.Tensor:
        if self.tensor is not None:
            return self.tensor
        assert self.recipe is not None
        base = self.recipe.output(self.index)
        self.recipe.unpacked(self.index)
        same = (base.storage_offset(), tuple(base.shape), tuple(base.stride()), base.dtype)
        if same == (self.offset, self.size, self.stride, self.dtype):
            return base
        view = torch.empty(0, dtype=self.dtype, device=base.device)
        with torch.no_grad():
            return view.set_(base.untyped_storage(), self.offset, self.size, self.stride)


def _unpacked(value: Any) -> Any:
    return value.unpack() if isinstance(value, Packed) else value


def _tensors(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage of a plain tensor with bytes (None for subclasses, sparse and empty)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
        return None
    storage = t.untyped_storage()
    return storage if storage.nbytes() > 0 else None


class _Scope:
    """The registry and hooks of one forward pass."""

    def __init__(self) -> None:
        self.registry: dict[int, tuple[Recipe, int, StorageWeakRef]] = {}
        self.pending: list[Packed] | None = None  # packs while an unpacked op runs
        self.plain = 0  # > 0 while a region is called: its inputs are saved plainly

    def pack(self, t: torch.Tensor) -> Any:
        if self.plain:
            return t
        storage = _storage(t)
        if storage is None:
            return t
        entry = self.registry.get(storage.data_ptr())
        if entry is not None and entry[2].expired():
            del self.registry[storage.data_ptr()]
            entry = None
        if entry is None:
            if self.pending is None:
                return t
            packed = Packed(t)  # maybe an output of the unpacked op running now
            self.pending.append(packed)
            return packed
        packed = Packed(t)
        packed.bind(entry[0], entry[1])
        return packed

    def run(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        recipe = Recipe(fn, args, kwargs)
        outer, self.pending = self.pending, []
        try:
            out = fn(*args, **kwargs)
            mine = self.pending
        finally:
            self.pending = outer
        by_ptr: dict[int, int] = {}
        for index, t in enumerate(_tensors(out)):
            storage = _storage(t)
            if storage is not None:
                by_ptr[storage.data_ptr()] = index
                self.registry[storage.data_ptr()] = (recipe, index, StorageWeakRef(storage))
        for packed in mine:
            storage = _storage(packed.tensor) if packed.tensor is not None else None
            if storage is not None and storage.data_ptr() in by_ptr:
                packed.bind(recipe, by_ptr[storage.data_ptr()])
        # An input that an earlier unpacked op returned: the recipe keeps a handle on that
        # op's recipe, not the tensor (chains of unpacked ops rebuild from what is kept).
        recipe.args, recipe.kwargs = tree_map(self._handle, (args, kwargs))
        return out

    def _handle(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        storage = _storage(value)
        entry = None if storage is None else self.registry.get(storage.data_ptr())
        if entry is None or entry[2].expired():
            return value
        packed = Packed(value)
        packed.bind(entry[0], entry[1])
        return packed


def _unpack_hook(packed: Any) -> Any:
    return packed.unpack() if isinstance(packed, Packed) else packed


_CURRENT: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar(
    "chkpt_opt_unpack_scope", default=None
)


def run_unpacked(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Calls an unpacked op (from a scope body): registers its outputs where a scope is
    active, else just calls it."""
    scope = _CURRENT.get()
    if scope is None:
        return fn(*args, **kwargs)
    return scope.run(fn, args, kwargs)


def call_keeping_inputs(region: CheckpointRegion, *args: Any) -> Any:
    """Calls a recompute region whose checkpoint saves its inputs plainly (a region keeps
    its inputs: see the module docstring)."""
    scope = _CURRENT.get()
    if scope is None:
        return region(*args)
    scope.plain += 1
    try:
        return region(*args)
    finally:
        scope.plain -= 1


@contextlib.contextmanager
def _active() -> Iterator[None]:
    scope = _Scope()
    token = _CURRENT.set(scope)
    try:
        with torch.autograd.graph.saved_tensors_hooks(scope.pack, _unpack_hook):
            yield
    finally:
        _CURRENT.reset(token)
        scope.registry.clear()


class UnpackScope(HookedBody):
    """Runs the part of the forward that holds unpacked ops under the scope's hooks (with
    gradients enabled, not while compiling). The body is held outside the module tree."""

    def __init__(self, body: torch.fx.GraphModule, names: tuple[str, ...]) -> None:
        super().__init__(body)
        self.names = names

    def hooks(self) -> contextlib.AbstractContextManager[None]:
        return _active()

    def extra_repr(self) -> str:
        return f"unpacked: {', '.join(self.names)}"


def outline_unpack_scope(gm: torch.fx.GraphModule, unpacked: frozenset[str]) -> None:
    """Moves the forward of ``gm`` from its first unpacked op on into an
    :class:`UnpackScope` (``gm`` is modified in place; the caller recompiles it).

    Raises:
        ScheduleError: an unpacked op that is not an op of ``gm``'s top graph.
    """
    nodes = list(gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    missing = sorted(n for n in unpacked if n not in by_name)
    if missing:
        raise ScheduleError(
            f"the schedule unpacks ops {missing[:3]} that the module's forward does not run "
            "outside its regions; it was made for another model or another trace of it."
        )
    first = min(nodes.index(by_name[n]) for n in unpacked)
    names = tuple(n.name for n in nodes[first:] if n.name in unpacked)

    def copy_node(
        sub: torch.fx.Graph, node: torch.fx.Node, env: dict[torch.fx.Node, torch.fx.Node]
    ) -> torch.fx.Node | None:
        target = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        if node.name in unpacked:
            return _unpacked_call(gm, sub, node, env)
        if isinstance(target, CheckpointRegion):
            region = sub.get_attr(str(node.target))
            args = tuple(torch.fx.map_arg(node.args, lambda x: env[x]))
            call = sub.call_function(call_keeping_inputs, (region, *args))
            call.meta = dict(node.meta)
            return call
        return None

    outline_forward(
        gm,
        first,
        copy_node,
        lambda body: UnpackScope(body, names),
        attribute="chkpt_unpack_scope",
        class_name="UnpackBody",
    )


def _unpacked_call(
    gm: torch.fx.GraphModule,
    sub: torch.fx.Graph,
    node: torch.fx.Node,
    env: dict[torch.fx.Node, torch.fx.Node],
) -> torch.fx.Node:
    """``node`` copied into ``sub`` as a call of :func:`run_unpacked` (a function's callee
    becomes an attribute of ``gm``, which the body copies)."""

    def store(target: Any) -> str:
        name = f"{_CALLEE}{node.name}"
        setattr(gm, name, target)
        return name

    return wrapped_call(sub, node, env, run_unpacked, store)
