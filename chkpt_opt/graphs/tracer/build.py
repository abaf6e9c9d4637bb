"""Builds the CostGraph of a captured model.

Three passes over the fx graph, all on fake tensors:

1. run the graph once as the model would (grad mode, parameters requiring grad), which
   gives every value's layout and ``requires_grad``;
2. find which values receive a gradient in the step (reverse reachability from the
   outputs), and where each parameter's gradient is created first;
3. probe every op in isolation (:mod:`.probe`) and turn its inputs, outputs and saved
   tensors into storage ids.

Passes 1 and 2 are :class:`~.fake_run.FakeRun`, the per-op probing of pass 3 is
:class:`~.op_nodes.OpNodes`; this module assembles the graph: its graph-level sizes, the
leaves of inputs and parameters, the nodes in order, the outputs and the cut flags.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx
from torch.utils._pytree import tree_flatten

from chkpt_opt.fx_attrs import fetch_attr
from chkpt_opt.graphs.costgraph import CostGraph, new_graph
from chkpt_opt.graphs.tracer.capture import Captured
from chkpt_opt.graphs.tracer.flops import device_model
from chkpt_opt.graphs.tracer.op_nodes import OpNodes, TensorLeaf

ProgressFn = Callable[[int, int], None]


class _Builder(OpNodes):
    """Runs the three passes and assembles the CostGraph."""

    def __init__(self, captured: Captured, name: str, progress: ProgressFn | None) -> None:
        super().__init__(captured)
        self.name = name
        self.progress = progress

    # ---- pass 3: the graph, one node per op (probed by OpNodes) ---------------------
    def build(self) -> CostGraph:
        self.run_fake()
        self.find_gradients()
        model = device_model(self.device_type)
        graph = new_graph(
            self.name,
            tracer=self.captured.method,
            torch_version=str(torch.__version__),
            cost_model=model.name,
        )
        self._graph_sizes(graph)
        leaves: dict[torch.fx.Node, list[TensorLeaf | None]] = {}
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                leaves[node] = [
                    TensorLeaf((), bool(getattr(x, "requires_grad", False)), static=True)
                    if isinstance(x, torch.Tensor)
                    else None
                    for x in self._tensor_leaves(node)
                ]
            elif node.op == "get_attr":
                value = fetch_attr(self.gm, str(node.target))
                is_param = isinstance(value, torch.nn.Parameter)
                leaves[node] = (
                    [
                        TensorLeaf(
                            (),
                            bool(is_param and value.requires_grad),
                            param=str(node.target) if is_param else None,
                            static=True,
                        )
                    ]
                    if isinstance(value, torch.Tensor)
                    else [None]
                )
        total = len(self.calls)
        for k, node in enumerate(self.calls):
            self._add_node(graph, node, leaves, model)
            if self.progress is not None:
                self.progress(k + 1, total)
        graph.graph["outputs"] = sorted(
            {n.name for n in self.outputs}, key=lambda s: graph.nodes[s]["index"]
        )
        # Written only where it differs from every output with a backward (the default):
        # a model's loss among outputs that get no gradient (logits).
        chosen = {n.name for n in self.differentiated}
        differentiated = [n for n in graph.graph["outputs"] if n in chosen]
        if differentiated != [n for n in graph.graph["outputs"] if graph.nodes[n]["has_backward"]]:
            graph.graph["grad_outputs"] = differentiated
        self._set_cut_flags(graph)
        return graph

    def _graph_sizes(self, graph: CostGraph) -> None:
        seen: set[int] = set()

        def nbytes(t: torch.Tensor) -> int:
            key = id(t.untyped_storage()) if t.device.type != "meta" else id(t)
            if key in seen:
                return 0
            seen.add(key)
            return (
                t.numel() * t.element_size()
                if t.device.type == "meta"
                else t.untyped_storage().nbytes()
            )

        params = list(self.gm.parameters())
        trainable = [p for p in params if p.requires_grad]
        graph.graph["n_trainable_tensors"] = len(trainable)
        graph.graph["largest_param_bytes"] = max(
            (p.numel() * p.element_size() for p in trainable), default=0
        )
        graph.graph["device_type"] = self.device_type
        graph.graph["param_bytes"] = sum(nbytes(p) for p in params)
        graph.graph["param_elements"] = sum(p.numel() for p in params)
        # FSDP2 pads every parameter's first dimension to a multiple of the world size.
        graph.graph["param_shapes"] = [
            [name, p.shape[0] if p.dim() else 1, p.numel(), p.element_size(), p.requires_grad]
            for name, p in self.gm.named_parameters()
        ]
        seen.clear()
        graph.graph["trainable_param_bytes"] = sum(nbytes(p) for p in params if p.requires_grad)
        seen.clear()
        graph.graph["buffer_bytes"] = sum(nbytes(b) for b in self.gm.buffers())
        seen.clear()
        graph.graph["input_bytes"] = sum(
            nbytes(x)
            for x in tree_flatten(self.captured.flat_inputs)[0]
            if isinstance(x, torch.Tensor)
        )

    def _set_cut_flags(self, graph: CostGraph) -> None:
        forbid: set[int] = set()
        owners = {sid: n for n, a in graph.nodes(data=True) for sid in a["outputs"]}
        for node in self.calls:
            idx = self.index[node]
            getitems = [u for u in node.users if self._is_tuple_getitem(u)]
            if getitems:
                last = max(self.index[u] for u in getitems)
                forbid.update(range(idx, last))
            attrs = graph.nodes[node.name]
            if attrs["is_inplace"]:
                for sid in attrs["aliases"]:
                    if sid in owners:
                        forbid.update(range(graph.nodes[owners[sid]]["index"], idx))
            if not self.grad_mode.get(node, True):
                forbid.update({idx - 1, idx})
        for _name, attrs in graph.nodes(data=True):
            attrs["cut_after_ok"] = attrs["index"] not in forbid


def build_cost_graph(
    captured: Captured, *, name: str, progress: ProgressFn | None = None
) -> CostGraph:
    """Builds the CostGraph of a captured model (see the module docstring)."""
    return _Builder(captured, name, progress).build()
