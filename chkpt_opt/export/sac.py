"""Lowering a schedule to an eager selective-checkpoint (SAC) policy with per-module wrapping.

PyTorch's selective activation checkpointing wraps a module in non-reentrant checkpoint
with ``create_selective_checkpoint_contexts(policy)``: the policy sees every ATen op the
module runs (after composite ops such as ``linear`` are decomposed into ``t`` and
``addmm``) and says whether to save its output or recompute it. This lowering:

* wraps every layer (see :func:`chkpt_opt.export.layers.find_layers`) that holds a
  recomputed op;
* inside a wrapped layer, marks ``MUST_SAVE`` the dispatcher ops issued by graph ops the
  schedule keeps, and ``PREFER_RECOMPUTE`` those issued by recomputed ones, keyed by full
  op overload name and occurrence count within one forward of the layer.

SAC keeps the *outputs* of saved ops where the keep-set schedule keeps what each op's
backward needs, and recomputes a whole wrapped layer when it is needed; so the lowering is
exact for whole-layer regions (the policy saves nothing) and approximate otherwise. Its
memory is measured, not simulated: :func:`measure_lowering` runs it.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from chkpt_opt.codegen.runtime import saveable_kernel
from chkpt_opt.errors import ScheduleError
from chkpt_opt.export.layers import find_layers, refuse_staged
from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes, storage_owners
from chkpt_opt.memory_model.schedule import Schedule


@dataclass(frozen=True)
class SacLowering:
    """Per-module SAC policies.

    Attributes:
        modules: module path (``"blocks.3"``) -> {op overload name: occurrences to save};
            every other op the module runs is recomputed.
        notes: what the lowering cannot express.
    """

    modules: dict[str, dict[str, tuple[int, ...]]]
    notes: tuple[str, ...] = ()


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def dispatched_ops(module: torch.fx.GraphModule, flat_inputs: list[Any]) -> dict[str, list[str]]:
    """The ATen ops (full overload names) that every call node issues, on fake tensors."""
    issued: dict[str, list[str]] = {}

    class _Interpreter(torch.fx.Interpreter):
        def run_node(self, node: torch.fx.Node) -> Any:
            if node.op not in ("call_function", "call_method", "call_module"):
                return super().run_node(node)
            with _Recorder() as recorder:
                out = super().run_node(node)
            issued[node.name] = [op for op in recorder.ops if not op.startswith("prim.")]
            return out

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        inputs = [fake.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in flat_inputs]
        _Interpreter(module).run(*inputs)
    return issued


@functools.cache
def _saveable(op_name: str) -> bool:
    """Whether SAC may cache the output of an op (see
    :func:`~chkpt_opt.codegen.runtime.saveable_kernel`)."""
    namespace, packet, overload = op_name.split(".")[-3:]
    try:
        op = getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    except AttributeError:
        return False
    return saveable_kernel(op)


def _written_in_place_later(graph: CostGraph) -> set[str]:
    """Ops whose output storage a later in-place op writes.

    SAC refuses to hand back a cached tensor that was mutated after it was cached, so these
    ops are recomputed rather than saved. An in-place op owns no storage and lists the one
    it writes in ``aliases`` (through any views), so its owner is the op to recompute.
    """
    owners = storage_owners(graph)
    return {
        owners[sid]
        for _, attrs in graph.nodes(data=True)
        if attrs["is_inplace"]
        for sid in attrs["aliases"]
        if sid in owners
    }


def lower_to_sac(graph: CostGraph, schedule: Schedule, issued: dict[str, list[str]]) -> SacLowering:
    """Builds the per-layer SAC policies standing for ``schedule``.

    Args:
        graph: the cost graph.
        schedule: the schedule to express.
        issued: :func:`dispatched_ops` of the traced module.

    Raises:
        ScheduleError: a staged schedule, which no per-layer policy expresses.
    """
    refuse_staged(schedule, "a per-layer selective-checkpoint policy")
    layers = find_layers(graph)
    order = ordered_nodes(graph)
    recomputed = schedule.recomputed_nodes()
    mutated = _written_in_place_later(graph)
    modules: dict[str, dict[str, tuple[int, ...]]] = {}
    in_layers: set[str] = set()
    for k, (start, stop) in enumerate(layers.spans):
        names = order[start:stop]
        in_layers.update(names)
        if not any(n in recomputed for n in names):
            continue
        counts: Counter[str] = Counter()
        saved: dict[str, list[int]] = {}
        for name in names:
            for op in issued.get(name, []):
                if name not in recomputed and name not in mutated and _saveable(op):
                    saved.setdefault(op, []).append(counts[op])
                counts[op] += 1
        modules[f"{layers.container}.{k}"] = {op: tuple(v) for op, v in saved.items()}
    notes = []
    if schedule.nested:
        notes.append(
            f"{len(schedule.nested)} nested regions are flattened: a per-layer policy "
            "recomputes each wrapped layer as one region"
        )
    if schedule.saved:
        notes.append(f"{len(schedule.saved)} cached ops are MUST_SAVE in their layer's policy")
    if schedule.unpacked:
        notes.append(
            f"{len(schedule.unpacked)} unpacked ops are kept: a per-layer policy has no "
            "recompute on unpack"
        )
    outside = [n for n in recomputed if n not in in_layers]
    if outside:
        notes.append(f"{len(outside)} recomputed ops lie outside the layers and are kept")
    if any(policy for policy in modules.values()):
        notes.append(
            "layers recomputed in part save the outputs of the kept ops (SAC's model), where "
            "the schedule keeps what their backward needs"
        )
    return SacLowering(modules=modules, notes=tuple(notes))


def selective_policy(saved: dict[str, tuple[int, ...]]) -> Any:
    """A SAC policy function that saves the occurrences ``saved`` lists of each op (by full
    overload name, counted within one call of the module) and recomputes every other op,
    counting separately in the forward pass and the recomputation."""
    counts: dict[bool, Counter[str]] = {False: Counter(), True: Counter()}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        name = str(op)
        seen = counts[ctx.is_recompute]
        k = seen[name]
        seen[name] += 1
        return (
            CheckpointPolicy.MUST_SAVE
            if k in saved.get(name, ())
            else CheckpointPolicy.PREFER_RECOMPUTE
        )

    def reset() -> None:
        counts[False].clear()
        counts[True].clear()

    policy.reset = reset  # type: ignore[attr-defined]
    return policy


class SacWrapped(torch.nn.Module):
    """A module run through non-reentrant checkpoint with a selective policy."""

    def __init__(self, module: torch.nn.Module, saved: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        self.module = module
        self.saved = saved

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        policy = selective_policy(self.saved)
        context = functools.partial(create_selective_checkpoint_contexts, policy)
        return checkpoint(self.module, *args, use_reentrant=False, context_fn=context, **kwargs)


def wrap_modules_in_place(model: torch.nn.Module, lowering: SacLowering) -> torch.nn.Module:
    """Wraps the lowering's modules of ``model`` with their SAC policies (in place).

    Like Hugging Face's ``gradient_checkpointing_enable``, this changes ``model`` itself;
    parameters are unchanged, their state-dict keys gain a ``.module`` level.
    """
    for path, saved in lowering.modules.items():
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        current = getattr(parent, child, None) if not child.isdigit() else parent[int(child)]
        if current is None:
            raise ScheduleError(f"module {path!r} is not in the model; was the plan made for it?")
        wrapped = SacWrapped(current, saved)
        if child.isdigit():
            parent[int(child)] = wrapped
        else:
            setattr(parent, child, wrapped)
    return model


def measure_lowering(
    model: torch.nn.Module,
    lowering: SacLowering,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
) -> int:
    """Peak bytes of one step of a SAC-wrapped copy of ``model`` (exact, CPU)."""
    from chkpt_opt.measurement.step import measure_step

    wrapped = wrap_modules_in_place(copy.deepcopy(model), lowering)
    return measure_step(wrapped, args, kwargs).peak_bytes
