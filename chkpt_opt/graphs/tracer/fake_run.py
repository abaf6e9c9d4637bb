"""Passes 1 and 2 of the cost-graph build, on fake tensors.

:class:`FakeRun` runs the captured fx graph once as the model would (grad mode, parameters
requiring grad), which gives every value's layout and ``requires_grad``, and then finds
which values receive a gradient in the step (reverse reachability from the outputs) and
where each parameter's gradient is created first. It also holds the fake-tensor helpers
the later pass uses (converting tensors and module state to fake tensors, materializing
an op's arguments).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

from chkpt_opt.errors import TraceError
from chkpt_opt.fx_attrs import fetch_attr
from chkpt_opt.graphs.tracer.capture import Captured
from chkpt_opt.graphs.tracer.ops import op_name
from chkpt_opt.graphs.tracer.step_outputs import differentiated_positions, loss_position


def is_call(node: torch.fx.Node) -> bool:
    """An op of the cost graph: every call node but export's input-guard module."""
    if node.op == "call_module" and str(node.target) == "_guards_fn":
        return False
    return node.op in ("call_function", "call_method", "call_module")


class FakeRun:
    """The captured graph run on fake tensors: values, grad modes and gradient flow."""

    def __init__(self, captured: Captured) -> None:
        self.captured = captured
        self.gm = captured.module
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.env: dict[torch.fx.Node, Any] = {}
        self.grad_mode: dict[torch.fx.Node, bool] = {}
        self.param_names = {id(p): n for n, p in self.gm.named_parameters(remove_duplicate=False)}
        self.calls = [n for n in self.gm.graph.nodes if is_call(n)]
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
                        self.env[node] = self._to_fake(fetch_attr(self.gm, str(node.target)))
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
        # The outputs the step differentiates (:mod:`.step_outputs`): a model's loss alone
        # where its output carries one, every output that requires grad otherwise.
        self.differentiated: list[torch.fx.Node] = []
        flat = tree_flatten((output_node.args, output_node.kwargs))[0]
        loss = self._loss_output(output_node, flat)
        for arg in flat:
            if isinstance(arg, torch.fx.Node) and is_call(arg):
                self.outputs.append(arg)
                if loss is not None and arg is not loss:
                    continue
                leaves = self._tensor_leaves(arg)
                for j, leaf in enumerate(leaves):
                    if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                        self.grad_leaves[arg][j] = True
                        if arg not in self.differentiated:
                            self.differentiated.append(arg)
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

    def _loss_output(self, output_node: torch.fx.Node, flat: list[Any]) -> torch.fx.Node | None:
        """The output node of the loss that the step differentiates alone, if the model's
        output carries one (see :mod:`.step_outputs`); None when every output is."""
        spec = getattr(self.gm, "_out_spec", None)  # torch.export: the flat outputs' structure
        if spec is None:  # torch.fx: the output node holds the returned structure itself
            if len(output_node.args) != 1 or output_node.kwargs:
                return None
            spec = tree_flatten(output_node.args[0])[1]
        if spec.num_leaves != len(flat):
            return None
        values = [self.env.get(a) if isinstance(a, torch.fx.Node) else a for a in flat]
        positions = differentiated_positions(values, spec)
        if len(positions) != 1 or positions[0] != loss_position(spec):
            return None
        found = flat[positions[0]]
        return found if isinstance(found, torch.fx.Node) and is_call(found) else None

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
                value = fetch_attr(self.gm, str(arg.target))
                if isinstance(value, torch.nn.Parameter) and value.requires_grad:
                    names.append(str(arg.target))
        return names

    def _is_tuple_getitem(self, node: torch.fx.Node) -> bool:
        if node.target is not operator.getitem or not isinstance(node.args[0], torch.fx.Node):
            return False
        return isinstance(self.env.get(node.args[0]), (tuple, list)) and isinstance(
            node.args[1], int
        )


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
