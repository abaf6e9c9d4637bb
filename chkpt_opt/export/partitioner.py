"""A partitioner that makes ``torch.compile`` keep and recompute what the plan keeps and recomputes.

AOTAutograd traces a compiled step's forward and backward into one joint graph; a
partitioner then decides which forward values the compiled backward receives (saved) and
which it recomputes. PyTorch's min-cut partitioner does not follow a plan's checkpoint
regions exactly, in both directions:

* it recomputes every op of a region, also a region output that eager PyTorch keeps
  because an op outside the region saved it, or because it is the input of the next
  region (non-reentrant checkpoint keeps a region's inputs). It then recomputes whole
  regions the plan keeps the outputs of;
* outside the regions it recomputes whatever it judges cheap (pointwise chains it can fuse),
  which the plan does not ask for.

:class:`PlanPartitioner` tags every op of the joint graph's forward pass with a checkpoint
policy before handing the graph to the min-cut partitioner, which honours the tags:

* an op outside every region: ``MUST_SAVE``, never recomputed (saved only if the backward
  reads it, as in eager);
* an op inside a region whose output eager keeps: ``MUST_SAVE`` on the op that owns the
  storage (a view is never saved by min-cut, its base is). Eager keeps it when a backward
  op of an op outside the region reads it (that op saved it), or when an op of another
  region reads it in the forward pass;
* an op inside a region that the plan caches (a selective-checkpoint ``MUST_SAVE`` in
  eager; codegen annotates its traced nodes, see
  :func:`~chkpt_opt.codegen.runtime.run_cached_for_compile`): ``MUST_SAVE`` on the nodes that
  own what it returns (:func:`cached_op_outputs`); the intermediates of its decomposition
  are recomputed;
* every other op inside a region: ``MUST_RECOMPUTE``.

Backward nodes are matched to the forward op they differentiate by autograd's sequence
number (``seq_nr``), which AOTAutograd copies onto both; a forward op that creates no
autograd node (a buffer update) carries the number of the op before it, so a number belongs
to the first forward node that carries it. Regions are the checkpoint regions
of the compiled module (``ac_graph_id``), so any module whose recompute regions are
non-reentrant checkpoints is honoured, not only a chkpt_opt plan.

What stays different from eager is what compiled code does inside kernels: fused kernels
materialise fewer intermediates and free buffers at other points, and some decompositions
save other tensors than eager autograd (a layer norm's statistics instead of its output).
:func:`chkpt_opt.export.compiled.measure_compiled` measures the result.

Example:
    >>> compiled = compile_module(plan.apply(for_compile=True))  # doctest: +SKIP
"""

from __future__ import annotations

import inspect
import logging
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._functorch import partitioners
from torch.utils.checkpoint import CheckpointPolicy

try:
    from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files
except ImportError:  # a torch without Inductor's partitioner hook: compile_module says so
    CustomPartitionerFn = object  # type: ignore[assignment,misc]
    get_hash_for_files = None  # type: ignore[assignment]

from chkpt_opt.codegen.runtime import CACHED_OP_ANNOTATION, CheckpointRegion, run_cached_for_compile
from chkpt_opt.errors import ChkptOptError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PartitionRecord:
    """What the partitioner decided for one compiled graph.

    Attributes:
        forward_ops: ops of the forward pass.
        saved_ops: ops tagged ``MUST_SAVE`` (outside every region, or kept region outputs).
        recomputed_ops: ops tagged ``MUST_RECOMPUTE``.
        kept_region_ops: region ops whose output is kept, as eager keeps it.
        cached_region_ops: the plan's cached ops whose outputs are saved, never
            recomputed (see :func:`cached_op_outputs`).
        saved_bytes: bytes of the activations the compiled forward saves for the backward
            (distinct storages; parameters and inputs excluded).
    """

    forward_ops: int
    saved_ops: int
    recomputed_ops: int
    kept_region_ops: int
    cached_region_ops: int
    saved_bytes: int


def _in_region(node: torch.fx.Node) -> bool:
    return partitioners.must_recompute(node)


def _storage_owner(node: torch.fx.Node, op_types: Any) -> torch.fx.Node:
    """The op whose output owns ``node``'s storage (walks back through views and getitem)."""
    while (op_types.is_view(node) or node.target is operator.getitem) and isinstance(
        node.args[0], torch.fx.Node
    ):
        node = node.args[0]
    return node


def _seq_owners(graph: torch.fx.Graph, forward: set[torch.fx.Node]) -> dict[Any, torch.fx.Node]:
    """The forward node that owns each ``seq_nr``: the first one carrying it.

    A forward node carries the sequence number of the last autograd node created when it
    was traced, so an op that creates none (an update of a buffer such as batch norm's
    ``num_batches_tracked += 1``, a view) carries the number of the differentiable op
    before it; all nodes of a decomposed op carry its number. The backward nodes with that
    number differentiate the first forward node carrying it. Matching by every forward node
    that carries it would count the buffer update right after a region as the owner of the
    backward of the region's last op, and keep that op's inputs.
    """
    owners: dict[Any, torch.fx.Node] = {}
    for node in graph.nodes:
        if node in forward and "seq_nr" in node.meta:
            owners.setdefault(node.meta["seq_nr"], node)
    return owners


def kept_region_outputs(graph: torch.fx.Graph, forward: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """The storage owners of region outputs that eager keeps for the backward pass.

    Args:
        graph: the joint graph, with checkpoint regions marked (``recompute`` and
            ``ac_graph_id`` in the nodes' meta).
        forward: the nodes the forward pass computes.
    """
    owners = _seq_owners(graph, forward)
    outside_seq = {seq for seq, owner in owners.items() if not _in_region(owner)}
    op_types = partitioners.get_default_op_list()
    kept: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node not in forward:
            continue
        region = node.meta.get("ac_graph_id") if _in_region(node) else None
        read_by_other_region = region is not None and any(
            u in forward and _in_region(u) and u.meta.get("ac_graph_id") != region
            for u in node.users
        )
        saved_outside = any(
            u not in forward and u.meta.get("seq_nr") in outside_seq for u in node.users
        )
        if read_by_other_region or saved_outside:
            owner = _storage_owner(node, op_types)
            if _in_region(owner):
                kept.add(owner)
    return kept


def _cached_op(node: torch.fx.Node) -> str | None:
    """The cached op whose traced nodes include ``node`` (its annotation), or None."""
    return node.meta.get("custom", {}).get(CACHED_OP_ANNOTATION)


def cached_op_outputs(graph: torch.fx.Graph, forward: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """The storage owners of what the plan's cached region ops return.

    A cached op may trace into several nodes (a decomposition); its outputs are those of
    its forward nodes that a node outside it reads (a later op, in the forward or the
    backward pass, or the graph's output), taken at the node owning their storage when
    that node is one of the op's own.

    Args:
        graph: the joint graph, its cached ops' nodes annotated (see
            :func:`~chkpt_opt.codegen.runtime.run_cached_for_compile`).
        forward: the nodes the forward pass computes.
    """
    op_types = partitioners.get_default_op_list()
    found: set[torch.fx.Node] = set()
    for node in graph.nodes:
        op = _cached_op(node)
        if op is None or node not in forward or not _in_region(node):
            continue
        if all(_cached_op(u) == op for u in node.users):
            continue  # read only inside the op (an intermediate of its decomposition)
        owner = _storage_owner(node, op_types)
        if owner in forward and _cached_op(owner) == op:
            found.add(owner)
    return found


def tag_plan_decisions(
    joint: torch.fx.GraphModule, forward: set[torch.fx.Node]
) -> tuple[int, int, int, int]:
    """Sets a checkpoint policy on every forward op of ``joint`` (see the module docstring).

    Returns:
        ``(saved ops, recomputed ops, kept region ops, cached ops saved)``.
    """
    kept = kept_region_outputs(joint.graph, forward)
    cached = cached_op_outputs(joint.graph, forward)
    saved = recomputed = 0
    for node in joint.graph.nodes:
        if node.op != "call_function" or node not in forward:
            continue
        if _in_region(node) and node not in kept and node not in cached:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            recomputed += 1
        else:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            saved += 1
    # The outputs of an op that returns a tuple are its getitems, and min-cut cannot save
    # the tuple: a getitem of a saved op is saved too, also one only the backward reads
    # (SDPA's logsumexp), which is no required forward node and keeps its region's
    # MUST_RECOMPUTE otherwise (then the op runs once, in the forward pass, and min-cut
    # finds that output neither saveable nor recomputable).
    for node in joint.graph.nodes:  # topological: nested getitems follow their producer
        producer = node.args[0] if node.target is operator.getitem and node.args else None
        if (
            isinstance(producer, torch.fx.Node)
            and producer.meta.get("recompute") == CheckpointPolicy.MUST_SAVE
        ):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    return saved, recomputed, len(kept), len({_cached_op(node) for node in cached})


def saved_activation_bytes(forward_module: torch.fx.GraphModule, num_fwd_outputs: int) -> int:
    """Bytes of the distinct storages a compiled forward saves (placeholders excluded)."""
    output = next(iter(forward_module.graph.find_nodes(op="output")))
    seen: set[Any] = set()
    total = 0
    for value in output.args[0][num_fwd_outputs:]:
        if not isinstance(value, torch.fx.Node) or value.op == "placeholder":
            continue
        tensor = value.meta.get("val")
        if not isinstance(tensor, torch.Tensor):
            continue
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in seen:
            continue
        seen.add(key)
        total += int(storage.nbytes())
    return total


@dataclass
class PlanPartitioner(CustomPartitionerFn):
    """Inductor's partitioner hook: tags the joint graph, then runs the min-cut partitioner.

    Attributes:
        records: one :class:`PartitionRecord` per graph partitioned (graphs served from
            PyTorch's compile caches are not partitioned again and add none).
        cached_ops: the names of the ops the module's regions cache (set by
            :func:`compile_module`). They are part of the cache key: the graph a region
            traces is the same whichever of its ops are cached (the annotations live in
            the nodes' meta), so without them PyTorch's compile caches would hand one
            plan's partition to another.
    """

    records: list[PartitionRecord] = field(default_factory=list)
    cached_ops: tuple[str, ...] = ()

    def __call__(
        self, gm: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        num_fwd_outputs = kwargs.get("num_fwd_outputs")
        if num_fwd_outputs is None:
            raise ChkptOptError(
                "PlanPartitioner was called without num_fwd_outputs; it is Inductor's "
                "partitioner hook, use it through chkpt_opt.compile_module."
            )
        static = kwargs.get("static_lifetime_input_indices") or []
        info = partitioners.classify_nodes(gm, static, num_fwd_outputs)
        forward = set(info.required_fw_nodes)
        saved, recomputed, kept, cached = tag_plan_decisions(gm, forward)
        fw_module, bw_module = partitioners.min_cut_rematerialization_partition(
            gm, joint_inputs, **kwargs
        )
        record = PartitionRecord(
            forward_ops=saved + recomputed,
            saved_ops=saved,
            recomputed_ops=recomputed,
            kept_region_ops=kept,
            cached_region_ops=cached,
            saved_bytes=saved_activation_bytes(fw_module, num_fwd_outputs),
        )
        self.records.append(record)
        log.debug("chkpt_opt partition: %s", record)
        return fw_module, bw_module

    def uuid(self) -> Any:
        """Cache key of the partition (PyTorch's compile caches): this file's contents and
        the cached ops."""
        return get_hash_for_files((__file__,)) + ",".join(self.cached_ops).encode()


def cached_op_names(target: torch.nn.Module | Callable[..., Any]) -> tuple[str, ...]:
    """The ops that the checkpoint regions of ``target`` cache, sorted: those their flat
    bodies (what ``torch.compile`` traces) call through ``run_cached_for_compile``. For a
    function (what ``torch.compile`` also takes), the regions of the modules it refers to:
    its closure, its globals and, for a bound method, its object."""
    names = {
        str(node.args[0])
        for module in _modules_of(target)
        for region in module.modules()
        if isinstance(region, CheckpointRegion)
        for node in region.flat_body.graph.nodes
        if node.target is run_cached_for_compile
    }
    return tuple(sorted(names))


def _modules_of(target: torch.nn.Module | Callable[..., Any]) -> list[torch.nn.Module]:
    if isinstance(target, torch.nn.Module):
        return [target]
    found = [getattr(target, "__self__", None)]
    if inspect.isfunction(target):
        refs = inspect.getclosurevars(target)
        found += [*refs.nonlocals.values(), *refs.globals.values()]
    return [m for m in found if isinstance(m, torch.nn.Module)]


def partitioner_hook_available() -> bool:
    """Whether this torch has Inductor's partitioner hook (``custom_partitioner_fn``)."""
    import torch._inductor.config as inductor_config

    return get_hash_for_files is not None and hasattr(inductor_config, "custom_partitioner_fn")


def compile_module(
    module: torch.nn.Module | Callable[..., Any],
    *,
    partitioner: PlanPartitioner | None = None,
    options: dict[str, Any] | None = None,
    **compile_kwargs: Any,
) -> Any:
    """``torch.compile`` with the plan's decisions honoured (Inductor backend).

    Args:
        module: a module from ``plan.apply(for_compile=True)`` or
            ``chkpt_opt.apply(..., for_compile=True)`` (any module whose recompute regions
            are non-reentrant checkpoints works), or a function that calls such modules
            (they are found through its closure and globals, for the compile cache key).
        partitioner: the partitioner to use (pass one to read its ``records``).
        options: further Inductor options.
        compile_kwargs: passed to ``torch.compile`` (``dynamic`` defaults to False: a plan
            is made for one input shape).

    Raises:
        ChkptOptError: for a backend other than Inductor (the hook is Inductor's), or a
            torch without the hook.

    Example:
        >>> compiled = chkpt_opt.compile_module(plan.apply(for_compile=True))  # doctest: +SKIP
    """
    if not partitioner_hook_available():
        raise ChkptOptError(
            f"torch {torch.__version__} has no Inductor partitioner hook "
            "(torch._inductor.config.custom_partitioner_fn), which compile_module needs; "
            "upgrade torch (2.13 has it), or compile plan.apply(for_compile=True) with "
            "torch.compile and check it with measure_compiled (the decisions are then "
            "PyTorch's partitioner's)."
        )
    backend = compile_kwargs.pop("backend", "inductor")
    if backend != "inductor":
        raise ChkptOptError(
            f"backend {backend!r}: the plan partitioner is an Inductor hook; compile with "
            "backend='inductor', or without compile_module to let the backend partition."
        )
    compile_kwargs.setdefault("dynamic", False)
    partitioner = partitioner or PlanPartitioner()
    partitioner.cached_ops = cached_op_names(module)
    merged = {**(options or {}), "custom_partitioner_fn": partitioner}
    return torch.compile(module, backend="inductor", options=merged, **compile_kwargs)
