"""Kernel workspace measured on the device: memory an op's kernels take from the allocator
and give back before the op returns, which no tensor shows.

The probe (:mod:`chkpt_opt.graphs.tracer.probe`) runs every op on fake tensors and counts
tensor storages, so scratch memory that a CUDA kernel takes from the caching allocator for
the length of one call is invisible to it: cuDNN's convolution workspace, or the staging
buffer of a reduction split across thread blocks (8 MiB for the bias gradient of a
``Linear(256, 256)`` on 4096 rows, on an H200). A plan predicted to fit exceeds its budget by
that much where such an op runs at the peak.

:func:`unseen_workspaces` runs the captured graph once for real, reading two rulers around
every op, forward as the graph runs and backward alone (on the op's inputs, detached): the
device's allocator and the storage tracker, the probe's ruler. What the allocator peaked at
beyond the tracker's peak (both counted from the op's start) is what the probe could not
see; :func:`add_unseen_workspaces` adds it to the op's forward and backward workspace in
the cost graph. What the allocator still holds after the op beyond its tensors was taken
once and kept (cuBLAS takes a workspace per thread on its first call), memory of the
process rather than of a step, and is left out. The allocator's 512-byte rounding of each
block counts: the step really takes it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.graphs.tracer.capture import Captured
from chkpt_opt.graphs.tracer.storage import StorageTracker
from chkpt_opt.measurement.module_state import preserved_state

log = logging.getLogger(__name__)


class Ruler(Protocol):
    """Live bytes of one memory pool, read around one op."""

    def start(self) -> None:
        """Begins a measurement at the bytes alive now."""

    def peak_bytes(self) -> int:
        """The highest bytes alive since :meth:`start`, above those alive at the start."""

    def live_bytes(self) -> int:
        """The bytes alive now, above those alive at the start."""


class CudaAllocatorRuler:
    """The CUDA caching allocator of ``device``: every block handed out, kernel scratch
    included, each rounded as the allocator rounds it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base = 0

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        self.base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self.base

    def live_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device) - self.base


class StorageRuler:
    """The storage tracker (tensor storages), which must be active while ops run."""

    def __init__(self, tracker: StorageTracker) -> None:
        self.tracker = tracker
        self.base = 0

    def start(self) -> None:
        self.tracker.reset_peak()
        self.base = self.tracker.live_bytes

    def peak_bytes(self) -> int:
        return self.tracker.peak_bytes - self.base

    def live_bytes(self) -> int:
        return self.tracker.live_bytes - self.base


def unseen_workspaces(
    module: torch.fx.GraphModule,
    flat_inputs: list[Any],
    nodes: dict[str, bool],
    *,
    allocator: Callable[[], Ruler] | None = None,
) -> dict[str, tuple[int, int]]:
    """``{node: (forward bytes, backward bytes)}`` the allocator held beyond the tensor
    storages while that node's op ran, for every name in ``nodes`` (``nodes[name]``: its
    backward runs in the step). The graph runs once without grad, each op's backward alone
    after its forward; buffers and the RNG states are restored afterwards. ``allocator``
    makes the ruler of the device's allocator (default: CUDA's, on the inputs' device); an
    op that fails alone (an in-place op on a leaf, say) is measured forward only.
    """
    device = next(
        (x.device for x in flat_inputs if isinstance(x, torch.Tensor)), torch.device("cpu")
    )
    make = allocator or (lambda: CudaAllocatorRuler(device))
    tracker = StorageTracker()
    runner = _Measuring(module, nodes, make(), StorageRuler(tracker))
    with preserved_state(module), torch.no_grad(), tracker:
        runner.run(*flat_inputs)
    return runner.found


def add_unseen_workspaces(
    graph: CostGraph, captured: Captured, allocator: Callable[[], Ruler] | None = None
) -> None:
    """Adds to every op's forward and backward workspace in ``graph`` what the device's
    allocator (``allocator`` makes its ruler; default CUDA's) held beyond the tensor
    storages while the op of ``captured`` ran (:func:`unseen_workspaces`); the graph's
    ``workspace_model`` then says ``measured-<device>``. Where the measurement fails the
    graph keeps the probe's workspace, as on the CPU, and a warning says so."""
    nodes = {name: bool(attrs["has_backward"]) for name, attrs in graph.nodes(data=True)}
    try:
        unseen = unseen_workspaces(
            captured.module, captured.flat_inputs, nodes, allocator=allocator
        )
    except Exception as err:  # the plan stands on the probe's workspace, as on the CPU
        log.warning(
            "could not measure kernel workspace on the device (%s: %s); predictions leave "
            "out what kernels take beyond their tensors",
            type(err).__name__,
            err,
        )
        return
    for name, (forward, backward) in unseen.items():
        attrs = graph.nodes[name]
        attrs["fwd_workspace_bytes"] += forward
        if attrs["has_backward"]:
            attrs["bwd_workspace_bytes"] += backward
    graph.graph["workspace_model"] = f"measured-{graph.graph['device_type']}"
    log.info(
        "kernel workspace unseen by the tracer: %d ops, at most %d bytes",
        sum(1 for f, b in unseen.values() if f or b),
        max((max(f, b) for f, b in unseen.values()), default=0),
    )


class _Measuring(torch.fx.Interpreter):
    def __init__(
        self,
        module: torch.fx.GraphModule,
        nodes: dict[str, bool],
        allocator: Ruler,
        storages: StorageRuler,
    ) -> None:
        super().__init__(module)
        self.nodes = nodes
        self.rulers = (allocator, storages)
        self.requires: dict[str, bool] = {}  # node -> its value takes part in autograd
        self.found: dict[str, tuple[int, int]] = {}

    def run_node(self, node: torch.fx.Node) -> Any:
        if node.name not in self.nodes:
            out = super().run_node(node)
            self.requires[node.name] = self._requires(node, out)
            return out
        out = self._unseen(lambda: super(_Measuring, self).run_node(node))
        value, forward = out
        self.requires[node.name] = self._requires(node, value)
        backward = 0
        if self.nodes[node.name]:
            try:
                backward = self._backward(node)
            except Exception as err:  # an op's backward that cannot run alone keeps the probe's
                log.debug("backward of %s not measured alone: %s", node.name, err)
        self.found[node.name] = (forward, backward)
        return value

    def _unseen(self, run: Callable[[], Any]) -> tuple[Any, int]:
        for ruler in self.rulers:
            ruler.start()
        value = run()
        allocator, storages = (ruler.peak_bytes() for ruler in self.rulers)
        # What the allocator still holds that no tensor does was taken once and kept (a
        # library's workspace on its first use, per thread): memory of the process, held
        # before any step, not scratch of this op.
        kept = max(0, self.rulers[0].live_bytes() - self.rulers[1].live_bytes())
        return value, max(0, allocator - kept - storages)

    def _requires(self, node: torch.fx.Node, value: Any) -> bool:
        tensors = [x for x in tree_flatten(value)[0] if isinstance(x, torch.Tensor)]
        if node.op in ("placeholder", "get_attr"):  # inputs, parameters, buffers
            return any(x.requires_grad for x in tensors)
        floating = any(x.dtype.is_floating_point or x.dtype.is_complex for x in tensors)
        return floating and any(self.requires.get(n.name, False) for n in node.all_input_nodes)

    def _backward(self, node: torch.fx.Node) -> int:
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        leaves, spec = tree_flatten((args, kwargs))
        flags = tree_flatten(
            torch.fx.node.map_arg((node.args, node.kwargs), lambda n: self.requires[n.name])
        )[0]
        if len(flags) != len(leaves):
            return 0
        inputs = []
        for i, (leaf, flag) in enumerate(zip(leaves, flags, strict=True)):
            if flag is True and isinstance(leaf, torch.Tensor) and leaf.dtype.is_floating_point:
                leaves[i] = leaf.detach().requires_grad_(True)
                inputs.append(leaves[i])
        if not inputs:
            return 0
        call_args, call_kwargs = tree_unflatten(leaves, spec)
        with torch.enable_grad():
            out = getattr(self, node.op)(node.target, call_args, call_kwargs)
        outs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor) and x.requires_grad]
        if not outs:
            return 0
        seeds = [torch.ones_like(x) for x in outs]
        _, unseen = self._unseen(
            lambda: torch.autograd.grad(outs, inputs, seeds, allow_unused=True)
        )
        return unseen
