"""Makes torch.export capture the program a model runs eagerly, not its export variant.

A plan is made for the example inputs' shapes and runs eagerly, so the program to capture
is the one the model runs eagerly. Two things make an exported program heavier than the
model's own:

* **Flags.** Models branch on whether they are exported or compiled to build a program
  valid for every input. :func:`eager_branches` makes Hugging Face's flag helpers read
  as they do eagerly while the model is exported.
* **Decisions on values the tracer does not see.** Under export every tensor is fake, so a
  branch on a tensor's values takes its general side even when the tensor is computed from
  constants alone and its value is known. Hugging Face's attention masks are the case that
  matters: eagerly, position ids that count up one by one mean "no packed sequences", the
  causal mask is skipped and SDPA gets ``is_causal=True`` (flash attention, grouped keys and
  values not repeated); under export the mask is materialized and keys and values are
  expanded per head (a 6-layer Llama's step then measures 7% more than the model's own).
  :func:`resolved_constant_branches` evaluates such a tensor for real when it depends on
  no input, parameter or buffer, and takes the branch eager takes; a tensor that depends on
  an input keeps the general program (it is correct for every input value).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

log = logging.getLogger(__name__)


_FLAG_HELPERS = ("is_torchdynamo_compiling", "is_torchdynamo_exporting")


@contextlib.contextmanager
def eager_branches(*, compiling: bool = False) -> Iterator[int]:
    """While a model is exported, Hugging Face's ``is_torchdynamo_exporting()`` reads False,
    as it does when the model runs eagerly, and so does ``is_torchdynamo_compiling()``
    unless ``compiling`` (for models whose eager ops have no traceable fake kernel, and that
    pick a traceable variant when compiled).

    Only the helpers of the ``transformers`` modules already imported are replaced (every
    module that holds one by name), never ``torch.compiler``'s own functions: export and
    Dynamo read those, and Dynamo keys its special cases on their identity. Yields the
    number of helpers replaced (0: the export is the plain one).
    """
    values = {"is_torchdynamo_compiling": compiling, "is_torchdynamo_exporting": False}
    replaced: list[tuple[Any, str, Any]] = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "transformers" or name.startswith("transformers.")):
            continue
        for helper in _FLAG_HELPERS:
            real = module.__dict__.get(helper)
            if callable(real):
                replaced.append((module, helper, real))
                setattr(module, helper, _reads_as(values[helper], real))
    try:
        yield len(replaced)
    finally:
        for module, helper, real in reversed(replaced):
            setattr(module, helper, real)


def _reads_as(value: bool, real: Any) -> Any:
    """A flag helper that reads ``value`` when the real flag is set (tracing), else False."""

    def helper() -> bool:
        return value and bool(real())

    return helper


def constant_value(tensor: torch.Tensor) -> torch.Tensor | None:
    """The real value of a tensor being traced, if it is computed from constants alone.

    Walks the traced graph back from ``tensor``; if no input, parameter, buffer or random
    op is among its ancestors, runs those ops for real (outside the fake mode) and returns
    the result. Returns None otherwise, or when nothing is being traced.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental import proxy_tensor

    mode = proxy_tensor.get_proxy_mode()
    if mode is None:
        return None
    slot = proxy_tensor.get_proxy_slot(tensor, mode.tracer, None)
    if slot is None:
        return None
    ancestors: dict[torch.fx.Node, None] = {}
    stack = [slot.proxy.node]
    while stack:
        node = stack.pop()
        if node in ancestors:
            continue
        if node.op != "call_function" or _is_random(node.target):
            return None
        ancestors[node] = None
        stack.extend(node.all_input_nodes)
    graph = torch.fx.Graph()
    copied: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in sorted(ancestors, key=_position(slot.proxy.node.graph)):
        copied[node] = graph.node_copy(node, lambda n: copied[n])
    graph.output(copied[slot.proxy.node])
    try:
        with unset_fake_temporarily(), proxy_tensor.disable_proxy_modes_tracing():
            value = torch.fx.GraphModule(torch.nn.Module(), graph)()
    except Exception as err:  # a device this machine lacks, an op that needs values
        log.debug("constant %s not evaluated: %s", slot.proxy.node.name, err)
        return None
    return value if isinstance(value, torch.Tensor) else None


@contextlib.contextmanager
def _flags_off() -> Iterator[None]:
    flags = (torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag)
    torch.compiler._is_compiling_flag = torch.compiler._is_exporting_flag = False
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag = flags


def _position(graph: torch.fx.Graph) -> Any:
    order = {node: i for i, node in enumerate(graph.nodes)}
    return lambda node: order[node]


def _is_random(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    return bool(schema is not None and schema.is_mutable) or "rand" in str(target)


@contextlib.contextmanager
def resolved_constant_branches() -> Iterator[list[str]]:
    """Hugging Face's value-dependent mask decisions, taken as eager takes them when the
    tensor they read is a constant (see the module docstring).

    Yields the list of decisions resolved so (their descriptions), filled while the model
    is exported. Does nothing when transformers is not imported or lacks these helpers.
    """
    resolved: list[str] = []
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if masking is None or original is None:
        yield resolved
        return

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        value = constant_value(position_ids)
        if value is not None:
            from torch._subclasses.fake_tensor import unset_fake_temporarily
            from torch.fx.experimental import proxy_tensor

            # eager's own test, on the real value, with the flags eager sees
            with (
                unset_fake_temporarily(),
                proxy_tensor.disable_proxy_modes_tracing(),
                _flags_off(),
            ):
                packed = original(value)
            if packed is None:
                resolved.append("position ids are constant and count up: no packed sequences")
                return None
        return original(position_ids)

    masking.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield resolved
    finally:
        masking.find_packed_sequence_indices = original
