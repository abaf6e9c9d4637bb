"""Codegen's runtime: the modules that run inside a training step.

The recompute flag (:func:`is_recomputing`), the guards that keep module state from being
updated twice while a region is recomputed (:class:`StateGuard`,
:class:`ModuleStateGuard`), and :class:`CheckpointRegion`, which calls an outlined region
through non-reentrant ``torch.utils.checkpoint`` and replays explicit generators.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx
import torch.fx.traceback
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from chkpt_opt.codegen.recursion_room import recursion_room, room_in_backward
from chkpt_opt.fx_attrs import fetch_attr

_RECOMPUTING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "chkpt_opt_recomputing", default=False
)


def is_recomputing() -> bool:
    """Whether the current code runs inside the recomputation of a region.

    Always False under ``torch.compile``: there AOT autograd recomputes regions from its
    functionalized graph, which applies module-state updates once, in the forward pass.
    """
    if torch.compiler.is_compiling():
        return False
    return _RECOMPUTING.get()


# Storages of the private copies of module state that the recomputations running now
# replay their in-place updates into (see CheckpointRegion._run).
_PRIVATE: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "chkpt_opt_private", default=frozenset()
)


def _is_private(value: Any) -> bool:
    """Whether ``value`` is (a view of) a private copy made by a running recomputation."""
    return isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in _PRIVATE.get()


@contextlib.contextmanager
def _private_copies(copies: Sequence[torch.Tensor]) -> Iterator[None]:
    token = _PRIVATE.set(_PRIVATE.get() | {c.untyped_storage().data_ptr() for c in copies})
    try:
        yield
    finally:
        _PRIVATE.reset(token)


@contextlib.contextmanager
def _recompute_flag() -> Iterator[None]:
    token = _RECOMPUTING.set(True)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)


def _contexts() -> tuple[
    contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]
]:
    return contextlib.nullcontext(), _recompute_flag()


# The region whose cached op is running now (set by the marks around that op in its body).
_CACHING: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "chkpt_opt_caching", default=None
)


def begin_cached_op(region: str) -> contextvars.Token[str | None] | None:
    """Marks the start of an op whose outputs ``region`` caches (called from region bodies)."""
    if torch.compiler.is_compiling():
        return None
    return _CACHING.set(region)


def end_cached_op(token: contextvars.Token[str | None] | None) -> None:
    """Marks the end of the op that :func:`begin_cached_op` started."""
    if token is not None:
        _CACHING.reset(token)


CACHED_OP_ANNOTATION = "chkpt_opt_cached_op"
"""The key of the annotation (``node.meta["custom"]``) that marks the nodes of a cached op
in a region that ``torch.compile`` traces; its value is the op's name. The plan
partitioner (:mod:`chkpt_opt.export.partitioner`) saves what such an op returns."""


def run_cached_for_compile(op: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Calls ``fn`` as the cached op ``op`` of a region's flat body (what ``torch.compile``
    traces): the nodes it traces carry the annotation :data:`CACHED_OP_ANNOTATION`."""
    with torch.fx.traceback.annotate({CACHED_OP_ANNOTATION: op}):
        return fn(*args, **kwargs)


@contextlib.contextmanager
def _cache_marks_scope() -> Iterator[None]:
    """Runs a region's body with no cached op marked, and clears its marks when it ends.

    Checkpoint stops a recomputation as soon as it has the tensors it needs, by raising
    inside the body: that can happen inside a cached op, after its
    :func:`begin_cached_op` and before its :func:`end_cached_op`. Without this scope the
    mark would outlive the step, and the next forward pass would cache every op of that
    region (including dropout's mask, which it then fills in place: "Tensor cached during
    selective activation checkpoint has been mutated").
    """
    token = _CACHING.set(None)
    try:
        yield
    finally:
        _CACHING.reset(token)


@contextlib.contextmanager
def _entered(*managers: contextlib.AbstractContextManager[Any]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield


_FACTORIES = ("empty", "zeros", "ones", "full", "rand", "scalar_tensor", "new_")


@functools.cache
def saveable_kernel(op: Any) -> bool:
    """Whether a selective-checkpoint policy may cache the output of kernel ``op``: not a
    view or in-place kernel (its output aliases another tensor: a cached view of an input
    would keep the input), not a factory (a composite op fills its output in place
    afterwards: ``zeros`` then ``scatter_`` in ``one_hot``, ``empty_like`` then
    ``bernoulli_`` in dropout, and checkpoint refuses a cached tensor that changed), not
    random."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return False
    packet = schema.name.split("::")[-1]
    if packet.startswith(_FACTORIES) or torch.Tag.nondeterministic_seeded in op.tags:
        return False
    if any(r.alias_info is not None for r in schema.returns):
        return False
    return not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _selective_contexts(
    region: str,
) -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    """Checkpoint contexts that cache the outputs of the ops marked for ``region`` (a
    selective-checkpoint policy: ``MUST_SAVE`` for them, recompute for everything else,
    including the cached ops of regions nested inside, which their own region caches)."""

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        # A composite op runs several kernels: cache those that make new storages and that
        # no later kernel fills in place (see saveable_kernel), recompute the others.
        if _CACHING.get() == region and saveable_kernel(func):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    forward, recompute = create_selective_checkpoint_contexts(policy)
    return _entered(forward), _entered(recompute, _recompute_flag())


class StateGuard(torch.nn.Module):
    """Runs a state-updating op normally, and without changing the state while recomputing.

    ``mode="momentum"``: a batch-norm op in training mode; on recompute its momentum is set
    to 0, so the running statistics are updated to exactly themselves (the output depends
    only on the batch statistics, and autograd saves the same tensors as in the forward
    pass). ``mode="skip"``: an in-place update of a buffer (``num_batches_tracked += 1``);
    on recompute it is skipped and the buffer returned. ``mode="copy"``: any other in-place
    write to module state; on recompute it writes into a copy.

    An in-place write into a private copy that an enclosing region's recomputation made
    of the state (its snapshot, which it replays the step's updates into) runs as in the
    forward pass: the outer region's later ops read the updated copy, and the state
    itself is not touched.
    """

    def __init__(self, op: Any, position: int, mode: str) -> None:
        super().__init__()
        self.op = op
        self.position = position
        self.mode = mode

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not is_recomputing():
            return self.op(*args, **kwargs)
        if self.mode != "momentum" and _is_private(args[self.position]):
            return self.op(*args, **kwargs)
        if self.mode == "skip":
            return args[self.position]
        values = list(args)
        if self.mode == "momentum":
            values[self.position] = 0.0
        else:
            values[self.position] = values[self.position].clone()
        return self.op(*values, **kwargs)


class ModuleStateGuard(torch.nn.Module):
    """Calls a batch-norm module; while recomputing, calls ``F.batch_norm`` with momentum 0
    (running statistics unchanged, ``num_batches_tracked`` not incremented)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_target", module)  # not a child: no duplicate state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        module = self._target
        if not is_recomputing():
            return module(x)
        return torch.nn.functional.batch_norm(
            x,
            module.running_mean,
            module.running_var,
            module.weight,
            module.bias,
            True,
            0.0,
            module.eps,
        )


class CheckpointRegion(torch.nn.Module):
    """Calls an outlined region through non-reentrant checkpoint.

    With a ``cache_key``, the region caches the outputs of the ops its body marks with that
    key (between :func:`begin_cached_op` and :func:`end_cached_op`) through a
    selective-checkpoint policy. A region's body may call inner regions: checkpoints nest.

    Activations reach the body as checkpoint arguments (checkpoint keeps them for the
    recomputation). Parameters and buffers are read from the root module at call time,
    inside the checkpointed function: they are not saved by checkpoint (an in-place buffer
    update would otherwise fail its version check on recompute), and the body always sees
    the module's current tensors, also after ``.to()``.

    Values that alias state written in place during the step (a buffer, a model input, or
    the result of an in-place op on them) are *live* values: passed after the activations
    (``n_acts`` of them come first), but to the body directly, not through checkpoint. The
    body takes ``(*activations, *live, *attrs)``. ``snapshot`` lists positions in
    ``(*live, *attrs)`` whose value the recomputation must see as it was when the region
    ran: a copy is taken then, and the recomputation reads it (a private copy of it for
    the positions in ``written``, which the region writes in place).

    ``replays_rng`` asks checkpoint to copy the default generators' state and replay it on
    recomputation; codegen sets it False for a region that draws no random numbers
    (:mod:`~chkpt_opt.codegen.randomness`), which then holds no copy of that state.

    The body and the root are held outside the module tree, so the optimized module has
    exactly the parameters, buffers and state_dict keys of the model.
    """

    def __init__(
        self,
        body: torch.fx.GraphModule,
        root: torch.nn.Module,
        attr_targets: tuple[str, ...],
        names: tuple[str, ...],
        *,
        n_acts: int | None = None,
        snapshot: tuple[int, ...] = (),
        written: tuple[int, ...] = (),
        generators: tuple[torch.Generator, ...] = (),
        for_compile: bool = False,
        cache_key: str = "",
        inner: tuple[CheckpointRegion, ...] = (),
        flat: tuple[torch.fx.GraphModule, tuple[str, ...]] | None = None,
        source: tuple[torch.fx.Graph, int, frozenset[str]] | None = None,
        replays_rng: bool = True,
    ) -> None:
        super().__init__()
        object.__setattr__(self, "_flat", flat)
        # A nested region's: what its outer region's flat body inlines, a copy of its graph,
        # its index, the ops it caches (codegen's rewrite._region_graph).
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "_inner", inner)  # called by the body: already in the tree
        object.__setattr__(self, "_body", body)
        object.__setattr__(self, "_root", root)
        object.__setattr__(self, "_const_generators", generators)
        self.attr_targets = attr_targets
        self.names = names
        self.n_acts = n_acts
        self.snapshot = snapshot
        self.written = written
        self.for_compile = for_compile
        self.replays_rng = replays_rng
        self._key = cache_key
        # Itself and the regions nested in it, deepest chain (see recursion_room).
        self.nesting_levels: int = 1 + max((r.nesting_levels for r in inner), default=0)

    @property
    def cache_key(self) -> str:
        """The key its body's cache marks carry."""
        return self._key

    @property
    def body(self) -> torch.fx.GraphModule:
        """The outlined graph of the region."""
        return self._body

    def _attrs(self) -> list[Any]:
        return [fetch_attr(self._root, t) for t in self.attr_targets]

    def _run(
        self,
        live: tuple[Any, ...],
        attrs: list[Any],
        generators: list[torch.Generator],
        generator_states: tuple[torch.Tensor, ...],
        calls: list[int],
        *args: Any,
    ) -> Any:
        n = len(args) if self.n_acts is None else self.n_acts
        acts, snapshots = args[:n], args[n:]
        statics = [*live, *attrs]
        calls[0] += 1
        if calls[0] == 1:
            # Checkpoint's first call of the function is this call's forward run, also when
            # it happens inside an outer region's recomputation (``is_recomputing()`` is
            # then True): explicit generators advance from where the outer replay set them,
            # and must not be reset afterwards, or the outer region's later random ops
            # would draw this region's numbers again.
            if self._key:
                # A selective-checkpoint policy replays kernels by their count in the
                # forward pass: the private copies the recomputation makes below must
                # have their count here too (copies dropped at once).
                for position in self.written:
                    statics[position].clone()
            with _cache_marks_scope():
                return self._body.forward(*acts, *statics)
        copies = []
        for position, snapshot in zip(self.snapshot, snapshots):
            # A private copy where the recomputation writes into it (it replays in-place
            # updates of this state), so the saved snapshot stays intact.
            statics[position] = snapshot.clone() if position in self.written else snapshot
            if position in self.written:
                copies.append(statics[position])
        with (
            recursion_room(self.nesting_levels),  # a recomputation during backward()
            _replayed_generators(generators, generator_states),
            _cache_marks_scope(),
            _private_copies(copies),
        ):
            # ``forward``, not the GraphModule's call: that one walks the traceback of every
            # exception passing through it, and checkpoint's early stop raises one through
            # every replay (about 40 microseconds each on a CPU).
            return self._body.forward(*acts, *statics)

    @property
    def flat_body(self) -> torch.fx.GraphModule:
        """The region's ops with its inner regions' inlined, unguarded (what a compiled
        region traces; see ``rewrite._flat_body``); the body where there is none."""
        return self._body if self._flat is None else self._flat[0]

    @property
    def flat_attr_targets(self) -> tuple[str, ...]:
        """The attributes :attr:`flat_body` takes after the body's arguments."""
        return () if self._flat is None else self._flat[1]

    def _run_for_compile(self, live: tuple[Any, ...], *acts: Any) -> Any:
        """The region as torch.compile traces it: its flat body, no replays (see
        :meth:`forward`)."""
        extra = [fetch_attr(self._root, t) for t in self.flat_attr_targets]
        return self.flat_body(*acts, *live, *self._attrs(), *extra)

    def _generators(self, statics: Sequence[Any]) -> list[torch.Generator]:
        """The explicit generators the region draws from, its inner regions' included."""
        found = [v for v in statics if isinstance(v, torch.Generator)]
        found += self._const_generators
        for region in self._inner:
            found += region._generators(region._attrs())
        return [g for k, g in enumerate(found) if all(g is not f for f in found[:k])]

    def forward(self, *args: Any) -> Any:
        n = len(args) if self.n_acts is None else self.n_acts
        acts, live = args[:n], tuple(args[n:])
        if self.for_compile or torch.compiler.is_compiling():
            # torch.compile traces checkpoint into a tagged region that its partitioner
            # recomputes from the functional graph; state updates happen once without
            # guards, snapshots or generator replays (none of which dynamo could trace).
            return checkpoint(
                functools.partial(self._run_for_compile, live),
                *acts,
                use_reentrant=False,
                preserve_rng_state=self.replays_rng,
            )
        # The attributes are read once per call: its forward run and its recomputation, in
        # the same step, see the same tensors (reading them again costs a module lookup
        # per attribute, tens of microseconds per region on a CPU).
        attrs = self._attrs()
        statics = [*live, *attrs]
        snapshots: tuple[torch.Tensor, ...] = ()
        if self.snapshot and torch.is_grad_enabled():
            snapshots = tuple(statics[j].detach().clone() for j in self.snapshot)
        # Checkpoint replays the default generators; explicit ones are replayed here.
        generators = self._generators(statics)
        states = tuple(g.get_state() for g in generators)
        with recursion_room(self.nesting_levels):
            outputs = checkpoint(
                functools.partial(self._run, live, attrs, generators, states, [0]),
                *acts,
                *snapshots,
                use_reentrant=False,
                preserve_rng_state=self.replays_rng,
                context_fn=(
                    functools.partial(_selective_contexts, self._key) if self._key else _contexts
                ),
            )
        room_in_backward(outputs, self.nesting_levels)
        return outputs

    def extra_repr(self) -> str:
        return f"{len(self.names)} ops: {self.names[0]} .. {self.names[-1]}"


@contextlib.contextmanager
def _replayed_generators(
    generators: Sequence[torch.Generator], states: Sequence[torch.Tensor]
) -> Iterator[None]:
    """Sets explicit generators to the states they had in the forward pass, and back."""
    current = [g.get_state() for g in generators]
    for generator, state in zip(generators, states):
        generator.set_state(state)
    try:
        yield
    finally:
        for generator, state in zip(generators, current):
            generator.set_state(state)
