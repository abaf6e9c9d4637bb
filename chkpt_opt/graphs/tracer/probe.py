"""Measures one op in isolation, on fake tensors: what it allocates, what autograd saves,
what its backward allocates, and its FLOPs.

The op runs on fresh fake inputs with the layouts (sizes, strides, offsets) and
``requires_grad`` flags it has in the model, under

* a saved-tensor hook that sees every tensor autograd keeps for the backward pass, which is
  then identified as one of the op's inputs, one of its outputs, or a buffer of its own;
* a :class:`StorageTracker`, for the bytes alive during and after the forward and backward;
* a FLOP counter.

Nothing real is allocated, so this works for models of any size (and on the meta device).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from chkpt_opt.graphs.tracer.flops import flop_counter
from chkpt_opt.graphs.tracer.storage import StorageTracker


@dataclass(frozen=True)
class LeafInfo:
    """What the tracer knows of one tensor input of an op.

    Attributes:
        requires_grad: the tensor requires grad in the model.
        param: qualified name when the tensor is a parameter, else None.
        inplace_target: the op writes into this input.
    """

    requires_grad: bool
    param: str | None = None
    inplace_target: bool = False


@dataclass
class ProbeResult:
    """The measured behaviour of one op.

    ``out_alias[j]`` is the input index that output leaf ``j`` views, ``-1`` when it owns a
    new storage (its storage group is ``out_group[j]``), ``-2`` when it is not a tensor or
    refers to memory outside the op (a constant).
    """

    out_alias: list[int] = field(default_factory=list)
    out_group: list[int] = field(default_factory=list)
    group_bytes: list[int] = field(default_factory=list)
    out_requires_grad: list[bool] = field(default_factory=list)
    saved_inputs: set[int] = field(default_factory=set)
    saved_outputs: set[int] = field(default_factory=set)
    saved_buffers: list[int] = field(default_factory=list)
    n_saved: int = 0
    fwd_workspace_bytes: int = 0
    bwd_workspace_bytes: int = 0
    grad_alias: bool = False
    param_grads: dict[str, int] = field(default_factory=dict)
    fwd_flops: int = 0
    bwd_flops: int = 0
    io_bytes: int = 0


def _fresh_input(meta: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A leaf tensor with the same layout as ``meta`` (inside the active fake mode)."""
    size, stride, offset = tuple(meta.shape), tuple(meta.stride()), meta.storage_offset()
    if meta.numel() == 0:
        extent = offset
    else:
        extent = offset + sum((s - 1) * st for s, st in zip(size, stride)) + 1
    base = torch.empty(max(extent, 1), dtype=meta.dtype, device=meta.device)
    tensor = base.as_strided(size, stride, offset).detach()
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage() is b.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return False


def probe_op(
    fn: Callable[..., Any],
    args: Any,
    kwargs: dict[str, Any],
    infos: Sequence[LeafInfo],
    *,
    grad_enabled: bool,
    grad_outputs: Sequence[bool] | None,
    first_param_grads: set[str],
) -> ProbeResult:
    """Runs ``fn(*args, **kwargs)`` once forward and once backward and measures it.

    Must be called inside an active FakeTensorMode; ``args``/``kwargs`` hold tensors whose
    metadata describes the inputs (in flattening order, matching ``infos``).

    Args:
        fn: the op.
        args: positional arguments (tensors are templates for fresh inputs).
        kwargs: keyword arguments.
        infos: one :class:`LeafInfo` per tensor leaf of ``(args, kwargs)``.
        grad_enabled: grad mode of the op in the model.
        grad_outputs: for each output leaf, whether a gradient reaches it in the step;
            None means the backward does not run.
        first_param_grads: parameters whose gradient this op's backward creates first (the
            others accumulate into an existing gradient).
    """
    leaves, spec = tree_flatten((args, kwargs))
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    if len(tensor_pos) != len(infos):
        raise ValueError("one LeafInfo per tensor input is required")
    inputs: list[torch.Tensor] = []
    used: list[torch.Tensor] = []
    for pos, info in zip(tensor_pos, infos):
        template = leaves[pos]
        rg = info.requires_grad and grad_enabled and template.dtype.is_floating_point
        fresh = _fresh_input(template, rg)
        inputs.append(fresh)
        value = fresh.clone() if (info.inplace_target and rg) else fresh
        used.append(value)
        leaves[pos] = value
    call_args, call_kwargs = tree_unflatten(leaves, spec)

    result = ProbeResult()
    result.io_bytes = sum(x.numel() * x.element_size() for x in used)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    tracker = StorageTracker()
    counter = flop_counter()
    with (
        torch.set_grad_enabled(grad_enabled),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        counter,
        tracker,  # innermost: FlopCounterMode decomposes some ops; the tracker sees them whole
    ):
        out = fn(*call_args, **call_kwargs)
    result.fwd_flops = int(counter.get_total_flops())
    fwd_peak = tracker.peak_bytes

    out_leaves = tree_flatten(out)[0]
    groups: list[torch.Tensor] = []
    for leaf in out_leaves:
        if not isinstance(leaf, torch.Tensor):
            result.out_alias.append(-2)
            result.out_group.append(-1)
            result.out_requires_grad.append(False)
            continue
        result.out_requires_grad.append(bool(leaf.requires_grad))
        alias = next((i for i, x in enumerate(used) if _same_storage(leaf, x)), None)
        if alias is None:
            alias = next((i for i, x in enumerate(inputs) if _same_storage(leaf, x)), None)
        if alias is not None:
            result.out_alias.append(alias)
            result.out_group.append(-1)
        elif tracker.is_tracked(leaf):
            group = next((g for g, t in enumerate(groups) if _same_storage(leaf, t)), None)
            if group is None:
                group = len(groups)
                groups.append(leaf)
                result.group_bytes.append(leaf.untyped_storage().nbytes())
            result.out_alias.append(-1)
            result.out_group.append(group)
        else:
            result.out_alias.append(-2)
            result.out_group.append(-1)
    result.io_bytes += sum(result.group_bytes)

    buffers: list[torch.Tensor] = []
    for t in saved:
        result.n_saved += 1
        j = next(
            (
                j
                for j, leaf in enumerate(out_leaves)
                if isinstance(leaf, torch.Tensor)
                and result.out_alias[j] == -1
                and _same_storage(t, leaf)
            ),
            None,
        )
        if j is not None:
            result.saved_outputs.add(j)
            continue
        i = next((i for i, x in enumerate(used) if _same_storage(t, x)), None)
        if i is None:
            i = next((i for i, x in enumerate(inputs) if _same_storage(t, x)), None)
        if i is not None:
            result.saved_inputs.add(i)
            continue
        if tracker.is_tracked(t) and not any(_same_storage(t, b) for b in buffers):
            buffers.append(t)
            result.saved_buffers.append(t.untyped_storage().nbytes())
    # Only autograd holds the saved tensors now, as in the model: a composite op's backward
    # frees its internal buffers one by one (math attention with dropout: 5 MiB above its
    # saved tensors at its peak, not the 9 MiB measured while they were all held here).
    saved.clear()
    buffers.clear()
    t = None  # the loop's last saved tensor
    result.fwd_workspace_bytes = max(0, fwd_peak - tracker.live_bytes)

    wants = [
        j
        for j, leaf in enumerate(out_leaves)
        if grad_outputs is not None
        and j < len(grad_outputs)
        and grad_outputs[j]
        and isinstance(leaf, torch.Tensor)
        and leaf.requires_grad
    ]
    targets = [i for i, x in enumerate(inputs) if x.requires_grad]
    if not wants or not targets:
        return result
    outs = [out_leaves[j] for j in wants]
    seeds = [torch.ones_like(o) for o in outs]
    tracker.reset_peak()
    base = tracker.live_bytes
    bwd_counter = flop_counter()
    with bwd_counter, tracker:  # the tracker innermost, as in the forward
        grads = torch.autograd.grad(
            outs, [inputs[i] for i in targets], seeds, allow_unused=True, materialize_grads=False
        )
    result.bwd_flops = int(bwd_counter.get_total_flops())
    new_act = 0
    new_first = 0
    cloned = 0
    aliases: list[bool] = []
    counted: list[torch.Tensor] = []
    for i, grad in zip(targets, grads):
        if grad is None:
            continue
        info = infos[i]
        is_alias = any(_same_storage(grad, s) for s in seeds)
        is_new = not is_alias and not any(_same_storage(grad, c) for c in counted)
        nbytes = grad.untyped_storage().nbytes() if is_new else 0
        if is_new:
            counted.append(grad)
        if info.param is None:
            aliases.append(is_alias)
            new_act += nbytes
            continue
        dense = grad.numel() * grad.element_size()
        result.param_grads[info.param] = dense
        if info.param in first_param_grads:
            new_first += nbytes
            if is_alias or grad.stride() != inputs[i].stride() or not grad.is_contiguous():
                cloned += dense  # AccumulateGrad copies gradients that break the layout
    result.grad_alias = bool(aliases) and all(aliases)
    workspace = tracker.peak_bytes - base - new_act - new_first
    result.bwd_workspace_bytes = max(0, workspace, cloned)
    return result


def dense_bytes(value: Any) -> int:
    """Bytes of a tensor as a dense array (the size of its gradient)."""
    if isinstance(value, torch.Tensor):
        return math.prod(value.shape) * value.element_size()
    return 0
