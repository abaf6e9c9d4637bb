"""Builds the CostGraph of a captured model.

Three passes over the fx graph, all on fake tensors:

1. run the graph once as the model would (grad mode, parameters requiring grad), which
   gives every value's layout and ``requires_grad``;
2. find which values receive a gradient in the step (reverse reachability from the
   outputs), and where each parameter's gradient is created first;
3. probe every op in isolation (:mod:`.probe`) and turn its inputs, outputs and saved
   tensors into storage ids.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

from chkpt_opt.errors import TraceError
from chkpt_opt.graphs.costgraph import CostGraph, new_graph, node_attrs
from chkpt_opt.graphs.tracer.capture import Captured
from chkpt_opt.graphs.tracer.flops import DeviceModel, device_model
from chkpt_opt.graphs.tracer.ops import (
    is_batch_norm_module,
    is_random,
    mutated_arg_positions,
    op_name,
    state_arg_positions,
)
from chkpt_opt.graphs.tracer.probe import LeafInfo, ProbeResult, dense_bytes, probe_op

log = logging.getLogger(__name__)

ProgressFn = Callable[[int, int], None]


@dataclass(frozen=True)
class _Leaf:
    """A tensor leaf of an fx value: the storages it refers to and where it comes from."""

    refs: tuple[str, ...]
    requires_grad: bool
    param: str | None = None
    static: bool = False


_NOT_TENSOR = object()


def _is_call(node: torch.fx.Node) -> bool:
    """An op of the cost graph: every call node but export's input-guard module."""
    if node.op == "call_module" and str(node.target) == "_guards_fn":
        return False
    return node.op in ("call_function", "call_method", "call_module")


def _fetch_attr(root: torch.nn.Module, target: str) -> Any:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


class _Builder:
    def __init__(self, captured: Captured, name: str, progress: ProgressFn | None) -> None:
        self.captured = captured
        self.gm = captured.module
        self.name = name
        self.progress = progress
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.env: dict[torch.fx.Node, Any] = {}
        self.grad_mode: dict[torch.fx.Node, bool] = {}
        self.param_names = {id(p): n for n, p in self.gm.named_parameters(remove_duplicate=False)}
        self.calls = [n for n in self.gm.graph.nodes if _is_call(n)]
        self.index = {n: i for i, n in enumerate(self.calls)}
        self.device_type = "cpu"

    # ---- pass 1: run on fake tensors -------------------------------------------------
    def _to_fake(self, value: Any, requires_grad: bool | None = None) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        fake = self.fake.from_tensor(value, static_shapes=True)
        rg = value.requires_grad if requires_grad is None else requires_grad
        if rg and fake.dtype.is_floating_point:
            fake = fake.detach().requires_grad_(True)
        return fake

    def _module_state(self, module: torch.nn.Module) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for key, p in module.named_parameters():
            state[key] = self._to_fake(p)
        for key, b in module.named_buffers():
            state[key] = self._to_fake(b)
        return state

    def _call(self, node: torch.fx.Node, args: Any, kwargs: Any) -> Any:
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            obj, *rest = args
            return getattr(obj, str(node.target))(*rest, **kwargs)
        module = self.gm.get_submodule(str(node.target))
        state = self._module_state(module)
        return torch.func.functional_call(module, state, tuple(args), kwargs)

    def run_fake(self) -> None:
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        inputs = dict(zip(placeholders, self.captured.flat_inputs))
        for value in self.captured.flat_inputs:
            if isinstance(value, torch.Tensor):
                self.device_type = value.device.type
                break
        grad_before = torch.is_grad_enabled()
        try:
            with self.fake, torch.enable_grad():
                for node in self.gm.graph.nodes:
                    self.grad_mode[node] = torch.is_grad_enabled()
                    if node.op == "placeholder":
                        self.env[node] = self._to_fake(inputs[node])
                    elif node.op == "get_attr":
                        self.env[node] = self._to_fake(_fetch_attr(self.gm, str(node.target)))
                    elif node.op == "output":
                        continue
                    elif node.op == "call_module" and str(node.target) == "_guards_fn":
                        self.env[node] = None
                    else:
                        args, kwargs = self._materialize(node)
                        try:
                            self.env[node] = self._call(node, args, kwargs)
                        except Exception as err:
                            raise TraceError(
                                f"op {op_name(node, self.gm)!r} (node {node.name!r}) cannot run on "
                                f"fake tensors: {type(err).__name__}: {str(err)[:300]}. "
                                f"{_fake_failure_reason(err)}"
                            ) from err
        finally:
            torch.set_grad_enabled(grad_before)

    def _materialize(self, node: torch.fx.Node) -> tuple[Any, Any]:
        def lookup(x: Any) -> Any:
            return self.env[x] if isinstance(x, torch.fx.Node) else x

        return tree_map(lookup, node.args), tree_map(lookup, node.kwargs)

    # ---- pass 2: who receives gradients ---------------------------------------------
    def _leaf_count(self, node: torch.fx.Node) -> int:
        return len(tree_flatten(self.env.get(node))[0])

    def _tensor_leaves(self, node: torch.fx.Node) -> list[Any]:
        return tree_flatten(self.env.get(node))[0]

    def find_gradients(self) -> None:
        """Fills ``self.grad_leaves[node]``: which output leaves receive a gradient."""
        output_node = next(n for n in self.gm.graph.nodes if n.op == "output")
        self.grad_leaves: dict[torch.fx.Node, list[bool]] = {
            n: [False] * self._leaf_count(n) for n in self.calls
        }
        self.outputs: list[torch.fx.Node] = []
        for arg in tree_flatten((output_node.args, output_node.kwargs))[0]:
            if isinstance(arg, torch.fx.Node) and _is_call(arg):
                self.outputs.append(arg)
                leaves = self._tensor_leaves(arg)
                for j, leaf in enumerate(leaves):
                    if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                        self.grad_leaves[arg][j] = True
        self.has_backward: dict[torch.fx.Node, bool] = {}
        for node in reversed(self.calls):
            marks = self.grad_leaves[node]
            hb = any(marks)
            self.has_backward[node] = hb
            if not hb:
                continue
            for arg in node.all_input_nodes:
                if arg not in self.grad_leaves:
                    continue
                leaves = self._tensor_leaves(arg)
                if self._is_tuple_getitem(node) and arg is node.args[0]:
                    picks = [node.args[1]]
                else:
                    picks = range(len(leaves))
                for j in picks:
                    leaf = leaves[j] if isinstance(j, int) and j < len(leaves) else None
                    if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                        self.grad_leaves[arg][j] = True
        # The first backward op to create each parameter's gradient (the last reader).
        self.first_param_grad: dict[str, torch.fx.Node] = {}
        for node in self.calls:
            if not self.has_backward[node]:
                continue
            for param in self._params_read(node):
                self.first_param_grad[param] = node

    def _params_read(self, node: torch.fx.Node) -> list[str]:
        names: list[str] = []
        if node.op == "call_module":
            module = self.gm.get_submodule(str(node.target))
            for key, p in module.named_parameters():
                if p.requires_grad:
                    names.append(f"{node.target}.{key}")
            return names
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                value = _fetch_attr(self.gm, str(arg.target))
                if isinstance(value, torch.nn.Parameter) and value.requires_grad:
                    names.append(str(arg.target))
        return names

    def _is_tuple_getitem(self, node: torch.fx.Node) -> bool:
        if node.target is not operator.getitem or not isinstance(node.args[0], torch.fx.Node):
            return False
        return isinstance(self.env.get(node.args[0]), (tuple, list)) and isinstance(
            node.args[1], int
        )

    # ---- pass 3: probes -------------------------------------------------------------
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
        leaves: dict[torch.fx.Node, list[_Leaf | None]] = {}
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                leaves[node] = [
                    _Leaf((), bool(getattr(x, "requires_grad", False)), static=True)
                    if isinstance(x, torch.Tensor)
                    else None
                    for x in self._tensor_leaves(node)
                ]
            elif node.op == "get_attr":
                value = _fetch_attr(self.gm, str(node.target))
                is_param = isinstance(value, torch.nn.Parameter)
                leaves[node] = (
                    [
                        _Leaf(
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

    def _input_leaves(
        self, node: torch.fx.Node, leaves: dict[torch.fx.Node, list[_Leaf | None]]
    ) -> list[_Leaf]:
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
        out: list[_Leaf] = []
        for value, desc in zip(materialized, described):
            if isinstance(value, torch.Tensor):
                out.append(desc if isinstance(desc, _Leaf) else _Leaf((), False, static=True))
        return out

    def _add_node(
        self,
        graph: CostGraph,
        node: torch.fx.Node,
        leaves: dict[torch.fx.Node, list[_Leaf | None]],
        model: DeviceModel,
    ) -> None:
        name = node.name
        index = self.index[node]
        value_leaves = self._tensor_leaves(node)
        preds = [a.name for a in node.all_input_nodes if _is_call(a)]
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
                result = probe_op(
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
        node_leaves: list[_Leaf | None] = []
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
                node_leaves.append(_Leaf(refs, rg, static=src.static and not refs))
            elif alias == -1:
                node_leaves.append(_Leaf((group_ids[result.out_group[j]],), rg))
            else:
                node_leaves.append(_Leaf((), rg, static=True))
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
        infos_src: list[_Leaf],
    ) -> tuple[Callable[..., Any], Any, Any, list[LeafInfo], list[_Leaf]]:
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
            extra_src.append(_Leaf((), rg, param=qual if is_param else None, static=True))

        def call_module(module_state: dict[str, Any], *a: Any, **k: Any) -> Any:
            return torch.func.functional_call(module, module_state, a, k)

        return (
            call_module,
            (state, *args),
            kwargs,
            extra_infos + infos,
            extra_src + infos_src,
        )

    def _conservative(self, node: torch.fx.Node, infos_src: list[_Leaf]) -> ProbeResult:
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
    node: torch.fx.Node, result: ProbeResult, device_type: str, infos: list[_Leaf]
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


def _fake_failure_reason(err: Exception) -> str:
    """Why an op cannot run on fake tensors, in words, with what to do."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )

    if isinstance(err, DynamicOutputShapeException):
        return (
            "Its output shape depends on tensor values (nonzero, masked_select, unique, "
            "boolean indexing...), which chkpt_opt cannot size: use a fixed-size form "
            "(torch.where, a mask, topk with a fixed k)."
        )
    if isinstance(err, DataDependentOutputException):
        return (
            "It reads a tensor's value into Python (.item(), float(), int(), bool(), .tolist(); "
            "batch norm with momentum=None does this), which chkpt_opt cannot trace: keep the "
            "value a tensor, or set a fixed momentum."
        )
    text = str(err).lower()
    no_kernel = ("fake impl", "meta kernel", "meta implementation", "meta function")
    if isinstance(err, UnsupportedOperatorException) or any(k in text for k in no_kernel):
        return (
            "The op has no fake-tensor (meta) kernel, which chkpt_opt needs to size it: "
            "register one (torch.library.register_fake)."
        )
    return "Its inputs or shapes do not fit the op, or its result depends on tensor values."


def build_cost_graph(
    captured: Captured, *, name: str, progress: ProgressFn | None = None
) -> CostGraph:
    """Builds the CostGraph of a captured model (see the module docstring)."""
    return _Builder(captured, name, progress).build()
