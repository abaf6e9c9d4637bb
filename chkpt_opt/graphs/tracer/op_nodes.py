"""Pass 3 of the cost-graph build: one cost-graph node per op.

:class:`OpNodes` probes every op in isolation (:mod:`.probe`) on the fake values of
:class:`~.fake_run.FakeRun` and turns its inputs, outputs and saved tensors into storage
ids, filling the node's attributes (sizes, saved storages, gradients, FLOPs and times,
flags) and its edges.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_map

from chkpt_opt.errors import TraceError
from chkpt_opt.graphs.costgraph import CostGraph, node_attrs
from chkpt_opt.graphs.tracer.capture import Captured
from chkpt_opt.graphs.tracer.fake_run import FakeRun, is_call
from chkpt_opt.graphs.tracer.flops import DeviceModel
from chkpt_opt.graphs.tracer.ops import (
    is_batch_norm_module,
    is_random,
    mutated_arg_positions,
    op_name,
    state_arg_positions,
)
from chkpt_opt.graphs.tracer.probe import LeafInfo, ProbeResult, dense_bytes
from chkpt_opt.graphs.tracer.probe_memo import ProbeMemo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorLeaf:
    """A tensor leaf of an fx value: the storages it refers to and where it comes from."""

    refs: tuple[str, ...]
    requires_grad: bool
    param: str | None = None
    static: bool = False


_NOT_TENSOR = object()


class OpNodes(FakeRun):
    """Adds the node of each op to the cost graph (see the module docstring)."""

    def __init__(self, captured: Captured) -> None:
        super().__init__(captured)
        self.probes = ProbeMemo()  # each distinct op probed once (.probe_memo)

    def _input_leaves(
        self, node: torch.fx.Node, leaves: dict[torch.fx.Node, list[TensorLeaf | None]]
    ) -> list[TensorLeaf]:
        """The descriptors of the tensor leaves of a node's arguments, in flattening order."""

        def describe(x: Any) -> Any:
            if not isinstance(x, torch.fx.Node):
                return x
            value = self.env.get(x)
            flat, spec = tree_flatten(value)
            descs = [_NOT_TENSOR if d is None else d for d in leaves.get(x) or ()]
            return spec.unflatten(descs) if len(descs) == len(flat) else value

        described = tree_flatten((tree_map(describe, node.args), tree_map(describe, node.kwargs)))[
            0
        ]
        materialized = tree_flatten(self._materialize(node))[0]
        out: list[TensorLeaf] = []
        for value, desc in zip(materialized, described):
            if isinstance(value, torch.Tensor):
                out.append(
                    desc if isinstance(desc, TensorLeaf) else TensorLeaf((), False, static=True)
                )
        return out

    def _add_node(
        self,
        graph: CostGraph,
        node: torch.fx.Node,
        leaves: dict[torch.fx.Node, list[TensorLeaf | None]],
        model: DeviceModel,
    ) -> None:
        name = node.name
        index = self.index[node]
        value_leaves = self._tensor_leaves(node)
        preds = [a.name for a in node.all_input_nodes if is_call(a)]
        common = {
            "index": index,
            "op": op_name(node, self.gm),
            "module_path": self._module_path(node),
            "has_backward": self.has_backward[node],
        }
        if self._is_tuple_getitem(node):
            src = (
                leaves[node.args[0]][node.args[1]]
                if node.args[1] < len(leaves[node.args[0]])
                else None
            )
            leaves[node] = [src]
            graph.add_node(
                name,
                **node_attrs(
                    **common,
                    aliases=list(src.refs) if src else [],
                    grad_bytes=dense_bytes(self.env[node]) if src and src.requires_grad else 0,
                    requires_grad=bool(src and src.requires_grad),
                    bwd_grad_alias=True,
                    fwd_time_s=model.op_overhead_s,
                    bwd_time_s=model.op_overhead_s,
                ),
            )
            self._add_edges(graph, name, preds, node)
            return

        infos_src = self._input_leaves(node, leaves)
        mutated = set(mutated_arg_positions(node, self.gm))
        tensor_arg_index = self._tensor_arg_positions(node)
        infos = [
            LeafInfo(
                requires_grad=d.requires_grad,
                param=d.param,
                inplace_target=tensor_arg_index[i] in mutated
                if i < len(tensor_arg_index)
                else False,
            )
            for i, d in enumerate(infos_src)
        ]
        first = {p for p, n in self.first_param_grad.items() if n is node}
        grad_mask = self.grad_leaves[node] if self.has_backward[node] else None
        args, kwargs = self._materialize(node)
        fn, args, kwargs, infos, infos_src = self._probe_callable(
            node, args, kwargs, infos, infos_src
        )
        try:
            with self.fake:
                result = self.probes.probe(
                    fn,
                    args,
                    kwargs,
                    infos,
                    grad_enabled=self.grad_mode[node],
                    grad_outputs=grad_mask,
                    first_param_grads=first,
                )
        except Exception as err:  # degrade to a conservative description, never crash
            log.warning(
                "probe of %s (%s) failed (%s); using a conservative estimate",
                name,
                op_name(node, self.gm),
                err,
            )
            result = self._conservative(node, infos_src)

        _full_buffer_reduction(node, result, self.device_type, infos_src)
        single = sum(1 for g in set(result.out_group) if g >= 0) == 1 and len(value_leaves) == 1
        group_ids = [name if single else f"{name}:{g}" for g in range(len(result.group_bytes))]
        outputs = {gid: nbytes for gid, nbytes in zip(group_ids, result.group_bytes)}
        node_leaves: list[TensorLeaf | None] = []
        aliases: list[str] = []
        for j, leaf in enumerate(value_leaves):
            rg = bool(result.out_requires_grad[j]) if j < len(result.out_requires_grad) else False
            if not isinstance(leaf, torch.Tensor) or j >= len(result.out_alias):
                node_leaves.append(None)
                continue
            alias = result.out_alias[j]
            if alias >= 0:
                src = infos_src[alias]
                refs = src.refs
                aliases.extend(r for r in refs if r not in aliases)
                node_leaves.append(TensorLeaf(refs, rg, static=src.static and not refs))
            elif alias == -1:
                node_leaves.append(TensorLeaf((group_ids[result.out_group[j]],), rg))
            else:
                node_leaves.append(TensorLeaf((), rg, static=True))
        leaves[node] = node_leaves

        sizes = dict(outputs)
        for pred in preds:
            sizes.update(graph.nodes[pred]["outputs"])
        saved: dict[str, int] = {}
        for i in sorted(result.saved_inputs):
            for ref in infos_src[i].refs:
                saved[ref] = self._storage_bytes(graph, ref)
        for j in sorted(result.saved_outputs):
            leaf = node_leaves[j] if j < len(node_leaves) else None
            for ref in leaf.refs if leaf else ():
                saved[ref] = self._storage_bytes(graph, ref, outputs)
        for k, nbytes in enumerate(result.saved_buffers):
            saved[f"{name}:buf{k}"] = nbytes

        requires_grad = any(leaf is not None and leaf.requires_grad for leaf in node_leaves)
        direct_readers = [u for u in node.users if not self._is_tuple_getitem(u)]
        grad_bytes = 0
        if requires_grad and (direct_readers or node in self.outputs):
            grad_bytes = sum(
                dense_bytes(v)
                for v, leaf in zip(value_leaves, node_leaves)
                if leaf is not None and leaf.requires_grad
            )
        flops_fwd = result.fwd_flops
        io = result.io_bytes
        if not outputs:
            io = 0
        elif flops_fwd == 0:
            flops_fwd = sum(v.numel() for v in value_leaves if isinstance(v, torch.Tensor))
        flops_bwd = result.bwd_flops if result.bwd_flops else (2 * flops_fwd if outputs else 0)
        inplace_static = (
            bool(mutated)
            and not aliases
            and any(
                infos_src[i].static
                for i in range(len(infos_src))
                if i < len(tensor_arg_index) and tensor_arg_index[i] in mutated
            )
        )
        stateful = bool(state_arg_positions(node, self.gm)) or inplace_static
        if node.op == "call_module":
            stateful = stateful or is_batch_norm_module(self.gm.get_submodule(str(node.target)))
        graph.add_node(
            name,
            **node_attrs(
                **common,
                outputs=outputs,
                aliases=aliases,
                saved=saved,
                n_saved=result.n_saved,
                fwd_workspace_bytes=result.fwd_workspace_bytes,
                bwd_workspace_bytes=result.bwd_workspace_bytes if self.has_backward[node] else 0,
                grad_bytes=grad_bytes,
                requires_grad=requires_grad,
                bwd_grad_alias=result.grad_alias,
                param_grad_bytes=sum(result.param_grads.get(p, 0) for p in first),
                fwd_flops=flops_fwd,
                bwd_flops=flops_bwd if self.has_backward[node] else 0,
                fwd_time_s=model.time_s(flops_fwd, io),
                bwd_time_s=model.time_s(flops_bwd, 2 * io) if self.has_backward[node] else 0.0,
                is_inplace=bool(mutated),
                is_random=is_random(node, self.gm),
                is_stateful=stateful,
            ),
        )
        self._add_edges(graph, name, preds, node)

    def _storage_bytes(self, graph: CostGraph, ref: str, own: dict[str, int] | None = None) -> int:
        if own and ref in own:
            return own[ref]
        owner = ref.split(":")[0]
        if owner in graph and ref in graph.nodes[owner]["outputs"]:
            return graph.nodes[owner]["outputs"][ref]
        for _, attrs in graph.nodes(data=True):
            if ref in attrs["outputs"]:
                return attrs["outputs"][ref]
        raise TraceError(f"internal error: storage {ref!r} has no owner in the graph")

    @staticmethod
    def _add_edges(graph: CostGraph, name: str, preds: list[str], node: torch.fx.Node) -> None:
        # `uses`: how many arguments read the value; autograd sums one gradient per use.
        flat = tree_flatten((node.args, node.kwargs))[0]
        for pred in dict.fromkeys(preds):
            uses = sum(1 for x in flat if isinstance(x, torch.fx.Node) and x.name == pred)
            graph.add_edge(pred, name, uses=max(1, uses))

    def _tensor_arg_positions(self, node: torch.fx.Node) -> list[int]:
        """For each tensor leaf of the arguments, the positional index of its argument."""
        positions: list[int] = []
        args, kwargs = self._materialize(node)
        for i, arg in enumerate(args):
            positions.extend(i for x in tree_flatten(arg)[0] if isinstance(x, torch.Tensor))
        for value in kwargs.values():
            positions.extend(-1 for x in tree_flatten(value)[0] if isinstance(x, torch.Tensor))
        return positions

    def _probe_callable(
        self,
        node: torch.fx.Node,
        args: Any,
        kwargs: Any,
        infos: list[LeafInfo],
        infos_src: list[TensorLeaf],
    ) -> tuple[Callable[..., Any], Any, Any, list[LeafInfo], list[TensorLeaf]]:
        if node.op == "call_function":
            return node.target, args, kwargs, infos, infos_src
        if node.op == "call_method":
            method = str(node.target)

            def call_method(obj: Any, *rest: Any, **kw: Any) -> Any:
                return getattr(obj, method)(*rest, **kw)

            return call_method, args, kwargs, infos, infos_src
        if str(node.target) == "_guards_fn":
            return (lambda *a, **k: None), args, kwargs, infos, infos_src
        module = self.gm.get_submodule(str(node.target))
        with self.fake:
            state = self._module_state(module)
        extra_infos = []
        extra_src = []
        for key, value in state.items():
            qual = f"{node.target}.{key}"
            is_param = key in dict(module.named_parameters())
            rg = bool(is_param and value.requires_grad)
            extra_infos.append(LeafInfo(requires_grad=rg, param=qual if is_param else None))
            extra_src.append(TensorLeaf((), rg, param=qual if is_param else None, static=True))

        def call_module(module_state: dict[str, Any], *a: Any, **k: Any) -> Any:
            return torch.func.functional_call(module, module_state, a, k)

        return (
            call_module,
            (state, *args),
            kwargs,
            extra_infos + infos,
            extra_src + infos_src,
        )

    def _conservative(self, node: torch.fx.Node, infos_src: list[TensorLeaf]) -> ProbeResult:
        """Upper-bound description of an op the probe could not run: saves all its inputs
        and outputs, owns every output."""
        result = ProbeResult()
        for j, leaf in enumerate(self._tensor_leaves(node)):
            if isinstance(leaf, torch.Tensor):
                result.out_alias.append(-1)
                result.out_group.append(len(result.group_bytes))
                result.group_bytes.append(dense_bytes(leaf))
                result.out_requires_grad.append(bool(leaf.requires_grad))
                result.saved_outputs.add(j)
            else:
                result.out_alias.append(-2)
                result.out_group.append(-1)
                result.out_requires_grad.append(False)
        result.saved_inputs = {i for i, d in enumerate(infos_src) if d.refs}
        result.n_saved = len(result.saved_inputs) + len(result.saved_outputs)
        return result

    def _module_path(self, node: torch.fx.Node) -> str:
        if node.op == "call_module":
            return str(node.target)
        stack = node.meta.get("nn_module_stack")
        if stack:
            path = list(stack.values())[-1]
            if isinstance(path, tuple):
                path = path[0]
            return str(path).replace("L['self'].", "").replace("L__self__.", "")
        return ""


# CPU kernels of these losses compute the unreduced loss into a buffer the size of the input
# and return the reduction as a view of it, so the scalar output keeps that whole storage
# alive. Meta kernels (what fake tensors run) allocate just the scalar. Value: position of
# the `reduction` argument (0 = none, which returns the full tensor anyway).
_CPU_FULL_BUFFER_REDUCTIONS = {
    "aten.mse_loss.default": 2,
    "aten.smooth_l1_loss.default": 2,
    "aten.binary_cross_entropy.default": 3,
}


def _full_buffer_reduction(
    node: torch.fx.Node, result: ProbeResult, device_type: str, infos: list[TensorLeaf]
) -> None:
    position = _CPU_FULL_BUFFER_REDUCTIONS.get(op_name(node))
    if position is None or device_type != "cpu" or not result.group_bytes:
        return
    reduction = (
        node.args[position] if len(node.args) > position else node.kwargs.get("reduction", 1)
    )
    first = node.args[0] if node.args else None
    value = first.meta.get("val") if isinstance(first, torch.fx.Node) else None
    if reduction == 0 or not isinstance(value, torch.Tensor):
        return
    result.group_bytes[0] = max(result.group_bytes[0], dense_bytes(value))
