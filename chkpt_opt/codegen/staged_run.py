"""The state of one forward and backward pass under a staged schedule: the pack and unpack
hooks, the recipes and instances kept, and the hooks on backward nodes that recompute
stages and end uses (the design is in :mod:`chkpt_opt.codegen.staged`)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any, NoReturn

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from chkpt_opt.codegen.rng_replay import rng_replayed, rng_states
from chkpt_opt.codegen.staged_plan import Key, StagedPlan
from chkpt_opt.errors import ScheduleError, short

Geometry = tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]


def _storage(t: Any) -> torch.UntypedStorage | None:
    """The storage of a plain tensor with bytes (None for subclasses, sparse and empty)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
        return None
    storage = t.untyped_storage()
    return storage if storage.nbytes() > 0 else None


def _leaves(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _geometry(t: torch.Tensor) -> Geometry:
    return (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _as(base: torch.Tensor, geometry: Geometry) -> torch.Tensor:
    """``base``'s storage seen with ``geometry`` (``base`` itself where it matches)."""
    if _geometry(base) == geometry:
        return base
    offset, size, stride, dtype = geometry
    view = torch.empty(0, dtype=dtype, device=base.device)
    with torch.no_grad():
        return view.set_(base.untyped_storage(), offset, size, stride)


def _new_storages(out: Any, inputs: Any) -> list[tuple[torch.Tensor, int]]:
    """The tensors of ``out`` whose storage no tensor of ``inputs`` has, one per storage, in
    the order of the outputs (the order of an op's output storages in the graph)."""
    seen = {s.data_ptr() for t in _leaves(inputs) if (s := _storage(t)) is not None}
    found = []
    for t in _leaves(out):
        storage = _storage(t)
        if storage is not None and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            found.append((t, storage.data_ptr()))
    return found


class _Ref:
    """A graph storage a recipe reads, with the geometry it read it with."""

    __slots__ = ("geometry", "sid")

    def __init__(self, sid: str, geometry: Geometry) -> None:
        self.sid, self.geometry = sid, geometry


class _Recipe:
    """The forward call of an op that a stage recomputes; ``versions`` are the version
    counters of the tensors it keeps (detached), as they were; ``grads`` says which leaves
    of its arguments required gradients in the forward."""

    __slots__ = ("args", "autocast", "fn", "grads", "kwargs", "rng", "versions")

    def __init__(
        self,
        fn: Any,
        args: Any,
        kwargs: Any,
        versions: list[Any],
        grads: tuple[bool, ...],
        random: bool = False,
    ) -> None:
        self.fn, self.args, self.kwargs, self.versions = fn, args, kwargs, versions
        self.grads = grads
        leaves = _leaves((args, kwargs))
        devices = {t.device.type for t in leaves} | {"cpu"}
        self.autocast = [
            (d, torch.get_autocast_dtype(d), torch.is_autocast_enabled(d))
            for d in sorted(devices)
            if torch.amp.is_autocast_available(d)
        ]
        self.rng = None  # a random op's: the generators' state as its forward call found it
        if random:
            cuda = sorted({t.device for t in leaves if t.device.type == "cuda"}, key=str)
            self.rng = rng_states([torch.device("cpu"), *cuda])


class _Handle:
    """A saved tensor as the pack hook keeps it: the tensor itself, or (once bound) the
    recomputed instance its saver's backward unpacks, with the tensor's geometry."""

    __slots__ = ("geometry", "key", "run", "saver", "tensor")

    def __init__(self, run: StagedRun, saver: str, tensor: torch.Tensor) -> None:
        self.run, self.saver, self.tensor = run, saver, tensor
        self.key: Key | None = None
        self.geometry = _geometry(tensor)

    def unpack(self) -> torch.Tensor:
        if self.key is None:
            assert self.tensor is not None
            return self.tensor
        return _as(self.run.unpacked(self.saver, self.key), self.geometry)


class StagedRun:
    """The state of one forward pass and of its backward pass."""

    def __init__(self, plan: StagedPlan) -> None:
        self.plan = plan
        self.left: Counter[Key] = Counter(plan.planned)  # uses of each instance to come
        self.store: dict[Key, torch.Tensor] = {}
        self.recipes: dict[str, _Recipe] = {}
        self.handles: Counter[tuple[str, Key]] = Counter()  # not yet unpacked, by saver
        self.bound: dict[str, set[Key]] = {}  # saver -> the instances its handles name
        self.finished: set[str] = set()  # savers whose backward has run
        self.ran: set[str] = set()  # stages that have run
        # forward only (cleared at its end: nothing the autograd graph holds keeps them)
        self.registry: dict[int, tuple[str, StorageWeakRef]] = {}
        self.nodes: dict[Any, str] = {}  # autograd node -> the first op returning it
        self.current: str | None = None
        self.pending: list[_Handle] | None = None

    # --- forward
    def _sid(self, t: torch.Tensor) -> str | None:
        storage = _storage(t)
        entry = None if storage is None else self.registry.get(storage.data_ptr())
        return None if entry is None or entry[1].expired() else entry[0]

    def pack(self, t: torch.Tensor) -> Any:
        """Saves ``t`` detached (autograd rebuilds the saved variable around it on unpack;
        a saved output kept with its ``grad_fn`` would hold its own node), or a handle."""
        if _storage(t) is None:
            return t
        sid = None if self.current is None else self._sid(t)
        if sid is None:
            if self.pending is None or self.current is None:
                return t.detach()
            handle = _Handle(self, self.current, t.detach())  # maybe an output of the op
            self.pending.append(handle)
            return handle
        key = self.plan.handles.get((self.current, sid))
        if key is None:
            return t.detach()
        handle = _Handle(self, self.current, t)
        self._bind(handle, key)
        return handle

    def _bind(self, handle: _Handle, key: Key) -> None:
        if key not in self.bound.setdefault(handle.saver, set()):
            self.bound[handle.saver].add(key)
            self.left[key] += 1  # the saver's backward is one use
        self.handles[(handle.saver, key)] += 1
        handle.key, handle.tensor = key, None

    def call(self, name: str, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Runs op ``name`` of the forward (see the module docstring)."""
        if name in self.plan.recomputed:
            versions: list[tuple[torch.Tensor, int]] = []

            def kept(value: Any) -> Any:  # a graph storage by reference, the rest detached
                if not isinstance(value, torch.Tensor):
                    return value
                sid = self._sid(value)
                if sid is not None:
                    return _Ref(sid, _geometry(value))
                versions.append((value.detach(), value._version))
                return versions[-1][0]

            grads = tuple(
                isinstance(x, torch.Tensor) and x.requires_grad
                for x in tree_flatten((args, kwargs))[0]
            )
            random = name in self.plan.replayed
            self.recipes[name] = _Recipe(
                fn, *tree_map(kept, (args, kwargs)), versions, grads, random
            )
        outer = (self.current, self.pending)
        self.current, self.pending = name, []
        try:
            out = fn(*args, **kwargs)
            mine = self.pending
        finally:
            self.current, self.pending = outer
        self._register(name, out, (args, kwargs), -1)
        for handle in mine:
            sid = self._sid(handle.tensor) if handle.tensor is not None else None
            key = None if sid is None else self.plan.handles.get((name, sid))
            if key is not None:
                self._bind(handle, key)
        if name in self.plan.buffers:
            self._bind_buffers(name, mine, (args, kwargs), out)
        if name in self.plan.backward:
            self._hook(name, out)
        return out

    def _bind_buffers(self, name: str, mine: list[_Handle], inputs: Any, out: Any) -> None:
        """Binds the forward's packs of op ``name``'s own buffers whose use takes a
        recomputed instance (the forward's buffer then dies with the op's call)."""
        packs = [h.tensor for h in mine if h.key is None and h.tensor is not None]
        found = self._own_buffers(name, packs, inputs, out, "in the forward")
        by_storage = {t.untyped_storage().data_ptr(): sid for t, sid in found}
        for handle in mine:
            storage = None if handle.tensor is None else _storage(handle.tensor)
            sid = None if storage is None else by_storage.get(storage.data_ptr())
            key = None if sid is None else self.plan.handles.get((name, sid))
            if key is not None:
                self._bind(handle, key)

    def _own_buffers(
        self, name: str, packs: list[torch.Tensor], inputs: Any, out: Any, when: str
    ) -> list[tuple[torch.Tensor, str]]:
        """The buffers among op ``name``'s ``packs`` (in pack order, each storage once, those
        that are neither an input nor an output: the tracer's rule), named as the graph
        names them.

        Raises:
            ScheduleError: their number or bytes differ from the graph's (at a smaller call,
                where the op's outputs are smaller than traced: their number, or one is
                larger than traced).
        """
        known = {s.data_ptr() for t in _leaves((inputs, out)) if (s := _storage(t)) is not None}
        found: dict[int, torch.Tensor] = {}
        for t in packs:
            storage = _storage(t)
            if storage is not None and storage.data_ptr() not in known:
                found.setdefault(storage.data_ptr(), t)
        expected = self.plan.buffers[name]
        sizes = [t.untyped_storage().nbytes() for t in found.values()]
        traced = [nbytes for _, nbytes in expected]
        if sizes != traced and not self._scaled_down(name, sizes, traced, inputs, out):
            raise ScheduleError(
                f"staged schedule: op {short(name)} saved buffers of its own of {sizes} bytes "
                f"{when} where its trace saw {[nbytes for _, nbytes in expected]}, so a "
                "recomputation cannot give its backward the buffers the schedule was made "
                f"for; trace the model again with these inputs, or drop {short(name)} from "
                "the stages."
            )
        return [(t, sid) for t, (sid, _) in zip(found.values(), expected)]

    def _scaled_down(
        self, name: str, sizes: list[int], traced: list[int], inputs: Any, out: Any
    ) -> bool:
        """Whether ``sizes`` fit a smaller call (a symbolic capture's smaller shape: outputs
        smaller than traced), where each buffer scales down with its sizes: none larger."""
        if len(sizes) != len(traced) or any(a > b for a, b in zip(sizes, traced)):
            return False
        made = [_storage(t) for t, _ in _new_storages(out, inputs)]
        return sum(s.nbytes() for s in made if s is not None) < self.plan.output_bytes.get(name, 0)

    def _register(self, name: str, out: Any, inputs: Any, step: int) -> None:
        """Names the storages op ``name`` returned (at recomputation ``step``, or -1 in the
        forward) and keeps those a later use takes."""
        sids = self.plan.outputs.get(name)
        if sids is None:
            return
        found = _new_storages(out, inputs)
        if len(found) != len(sids):
            raise ScheduleError(
                f"staged schedule: op {short(name)} returned {len(found)} new storages where "
                f"its trace saw {len(sids)}: the module runs another program than the one "
                "the schedule was made for. Trace the model again with these inputs."
            )
        for (t, ptr), sid in zip(found, sids):
            if step < 0:
                self.registry[ptr] = (sid, StorageWeakRef(t.untyped_storage()))
            if self.left[(sid, step)] > 0:
                self.store[(sid, step)] = t.detach()

    def _hook(self, name: str, out: Any) -> None:
        """Hooks a stage, and a saver of recomputed instances, on the autograd node of op
        ``name``'s output."""
        tensors = _leaves(out)
        node = next((t.grad_fn for t in tensors if t.grad_fn is not None), None)
        if node is None:
            if name in self.plan.stages and any(t.requires_grad for t in tensors):
                raise ScheduleError(
                    f"staged schedule: the autograd node of op {short(name)} cannot be found "
                    "(its output has no grad_fn), so its stage cannot run before it; move "
                    "the stage to the op that computes its output."
                )
            self.finished.add(name)  # no node to wait for: its unpacks end its uses
            return
        owner = self.nodes.setdefault(node, name)
        if name in self.plan.stages:
            if owner != name:
                raise ScheduleError(
                    f"staged schedule: op {short(name)} returns a tensor of op {short(owner)} "
                    "and has no autograd node of its own, so its backward runs as part of "
                    f"{short(owner)}'s; move the stage of {short(name)} to {short(owner)}."
                )
            node.register_prehook(lambda _grads, name=name: self.run_stage(name))
        if name in self.bound:
            node.register_hook(lambda _inputs, _outputs, name=name: self.saver_done(name))

    def end_forward(self) -> None:
        self.registry.clear()
        self.nodes.clear()

    # --- backward
    def run_stage(self, name: str) -> None:
        """The pre-hook of stage ``name``: its recomputations, in order."""
        if name in self.ran:
            raise ScheduleError(
                f"staged schedule: the backward of op {short(name)} runs a second time over "
                "one forward (retain_graph=True?), but a staged step frees what it "
                "recomputed after its one backward pass. Run the forward again for each "
                "backward pass."
            )
        self.ran.add(name)
        for j in self.plan.stages[name]:
            self._recompute(j)

    def _recompute(self, j: int) -> None:
        name = self.plan.steps[j]
        recipe = self.recipes.get(name)
        if recipe is None:
            raise ScheduleError(
                f"staged schedule: op {short(name)} did not run in the forward, so it cannot "
                "be recomputed; the schedule was made for another trace of the model."
            )
        if any(t._version != version for t, version in recipe.versions):
            raise ScheduleError(
                f"staged schedule: an input of op {short(name)} was written in place after "
                f"{short(name)} ran, so its recomputation would read another value; drop "
                f"{short(name)} from the stages."
            )
        reads = self.plan.reads[j]

        def value(x: Any) -> Any:
            if not isinstance(x, _Ref):
                return x
            if x.sid not in reads:
                raise ScheduleError(
                    f"staged schedule: op {short(name)} reads storage {short(x.sid)}, which "
                    "its trace does not show it reading; trace the model again."
                )
            return _as(self._held(reads[x.sid], f"an input of {short(name)}"), x.geometry)

        args, kwargs = tree_map(value, (recipe.args, recipe.kwargs))
        with rng_replayed(recipe.rng):
            if name in self.plan.buffers:
                out = self._recording(j, recipe, args, kwargs)
            else:
                with _replaying(recipe, grad=False):
                    out = recipe.fn(*args, **kwargs)
        if self.plan.replayed.get(name) == j:
            recipe.rng = None  # its last recomputation
        self._register(name, out, (args, kwargs), j)
        del args, kwargs, out
        for key in reads.values():
            self._release(key)

    def _recording(self, j: int, recipe: _Recipe, args: Any, kwargs: Any) -> Any:
        """Recomputation step ``j`` of an op that saves buffers of its own: runs it with
        autograd recording (its inputs requiring gradients as in the forward) under a hook
        that captures what it saves, keeps the buffers later uses take, and returns its
        outputs detached (the temporary autograd graph dies with the call)."""
        leaves, spec = tree_flatten((args, kwargs))
        args, kwargs = tree_unflatten(
            [
                x.detach().requires_grad_() if grad else x
                for x, grad in zip(leaves, recipe.grads, strict=True)
            ],
            spec,
        )
        packs: list[torch.Tensor] = []
        try:
            hooks = torch.autograd.graph.saved_tensors_hooks(packs.append, _unused)
            with _replaying(recipe, grad=True), hooks:  # the graph holds nothing it saves
                out = recipe.fn(*args, **kwargs)
            out = tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out)
            name = self.plan.steps[j]
            found = self._own_buffers(name, packs, (args, kwargs), out, "at a recomputation")
        finally:
            # the captured tensors' graph holds the hook, and so the list: a cycle through
            # C++ that the garbage collector cannot see
            packs.clear()
        for t, sid in found:
            if self.left[(sid, j)] > 0:
                self.store[(sid, j)] = t.detach()
        return out

    def unpacked(self, saver: str, key: Key) -> torch.Tensor:
        """A handle of ``saver`` on ``key`` is unpacked; the saver's use ends with its last
        handle once its backward has run."""
        held = self._held(key, f"a tensor that op {short(saver)} saved")
        self.handles[(saver, key)] -= 1
        if self.handles[(saver, key)] == 0 and saver in self.finished:
            self._release(key)
        return held

    def saver_done(self, saver: str) -> None:
        """The post-hook of a saver's node: its uses whose handles are all unpacked end."""
        if saver in self.finished:
            return
        self.finished.add(saver)
        for key in self.bound[saver]:
            if self.handles[(saver, key)] == 0:
                self._release(key)

    def _held(self, key: Key, what: str) -> torch.Tensor:
        held = self.store.get(key)
        if held is None:
            raise ScheduleError(
                f"staged schedule: {what} was needed before the stage that recomputes it ran "
                "or after its last planned use (the backward ran in another order than the "
                "schedule's, or a second time); run the forward again for each backward pass."
            )
        return held

    def _release(self, key: Key) -> None:
        self.left[key] -= 1
        if self.left[key] <= 0:
            self.store.pop(key, None)


@contextlib.contextmanager
def _replaying(recipe: _Recipe, grad: bool) -> Iterator[None]:
    """The forward's autocast state, with autograd recording (``grad``) or without."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.enable_grad() if grad else torch.no_grad())
        for device, dtype, enabled in recipe.autocast:
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
        yield


def _unused(_packed: None) -> NoReturn:
    """The unpack hook of a recomputation's graph, which no backward runs (it is dropped
    once the recomputation has captured its buffers)."""
    raise AssertionError("the autograd graph of a staged recomputation ran a backward")


def unpack_staged(packed: Any) -> Any:
    """The unpack hook of a staged forward."""
    return packed.unpack() if isinstance(packed, _Handle) else packed
