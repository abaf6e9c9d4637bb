"""Batches the training loop fetches during a step, seen at the start of its backward pass.

nanoGPT's ``train.py`` fetches the next micro-batch between the forward and the backward
pass (``X, Y = get_batch('train')`` after the forward), so that its copy to the device
overlaps the backward: through the backward, the step holds that batch beside the one it
runs on, which autograd keeps (the embedding saves its indices, the loss its targets).
The batches alive at the call are counted there (:mod:`.held_batches`); this one is not
alive yet, and a plan that uses the budget to the byte runs over it by the batch's bytes.

:func:`watch_fetches` looks once per runner, at the start of the backward pass (a hook on
the tensors the step differentiates), at the variables of the loop: the local variables of
the frames of the thread that called the model, outside torch and chkpt_opt (a module-level
script's are its globals; on CUDA the hook runs on autograd's device thread),
and the tensors in the mappings, lists and tuples they hold (two levels, up to
:data:`MAX_ITEMS` items each). A tensor there with the dtype, the device and the whole
shape of one of the call's own inputs that was not among those variables at the call, nor
an input of it or a tensor of the model, is a fetched batch. Its bytes, beyond the ones the
runner's plan counts for fetches, are counted, as a share of the call's own input bytes, in
every plan from then on; the runner is planned again where its predicted peak plus them is
over the budget (:func:`uncounted_fetch`). Not seen: a batch fetched in another shape (the
next one padded to another length), or held where the loop's variables do not reach (an
attribute of an object). The tensors the rewritten module keeps for the backward pass are
not in the loop's variables, and not mistaken for a batch.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from chkpt_opt.attachment.held_batches import model_storages, storage_ptr
from chkpt_opt.attachment.runner import Runner
from chkpt_opt.graphs.tracer.step_outputs import grad_outputs
from chkpt_opt.step_budget.budget import format_bytes

log = logging.getLogger(__name__)

MAX_ITEMS = 256
"""Containers in the loop's variables with more items than this are not looked into."""

_LIBRARIES = ("torch", "chkpt_opt")


@dataclass(frozen=True)
class FetchWatch:
    """What a call leaves to compare with at its backward pass's start.

    Attributes:
        shapes: ``(dtype, device, shape)`` of the call's own tensor inputs.
        before: storage addresses of the call's inputs, of the model's parameters, buffers
            and gradients, and of the tensors of those shapes in the loop's variables, at
            the call.
        own_bytes: bytes of the call's own tensor inputs (each storage once).
        thread: the thread that made the call (the loop's: a backward pass on CUDA runs
            its hooks on autograd's device threads, whose stacks hold no loop).
    """

    shapes: frozenset[tuple[Any, ...]]
    before: frozenset[int]
    own_bytes: int
    thread: int


def fetch_watch(model: torch.nn.Module, call_inputs: Any) -> FetchWatch:
    """The :class:`FetchWatch` of a call to ``model`` with ``call_inputs``, at the call."""
    own = _own_tensors(call_inputs)
    storages = _storage_bytes(own)
    shapes = frozenset((t.dtype, t.device, tuple(t.shape)) for t in own)
    thread = threading.get_ident()
    before = set(storages) | model_storages(model) | set(_batches_in_loop(shapes, thread))
    return FetchWatch(shapes, frozenset(before), sum(storages.values()), thread)


def input_bytes(call_inputs: Any) -> int:
    """Bytes of a call's own tensor inputs, each storage once (:attr:`FetchWatch.own_bytes`)."""
    return sum(_storage_bytes(_own_tensors(call_inputs)).values())


def _own_tensors(call_inputs: Any) -> list[torch.Tensor]:
    return [v for v in tree_flatten(call_inputs)[0] if isinstance(v, torch.Tensor) and v.dim() > 0]


def _storage_bytes(tensors: list[torch.Tensor]) -> dict[int, int]:
    """Storage address -> bytes, for the storages of ``tensors``."""
    return {storage_ptr(t): t.untyped_storage().nbytes() for t in tensors}


def fetched_bytes(watch: FetchWatch) -> int:
    """Bytes (each storage once) of the tensors in the loop's variables now shaped as the
    call's inputs that were not there at the call (see the module docstring)."""
    found = _batches_in_loop(watch.shapes, watch.thread)
    return sum(nbytes for ptr, nbytes in found.items() if ptr not in watch.before)


def watch_fetches(out: Any, watch: FetchWatch, observe: Callable[[int], None]) -> None:
    """Calls ``observe(nbytes)`` once, at the start of the backward pass of ``out`` (a
    model's outputs: the first gradient that reaches one the step differentiates), with
    :func:`fetched_bytes` then."""
    seen = False

    def at_backward(grad: torch.Tensor) -> None:
        nonlocal seen
        if not seen:
            seen = True
            observe(fetched_bytes(watch))

    for tensor in grad_outputs(out):
        tensor.register_hook(at_backward)


def uncounted_fetch(
    runner: Runner, nbytes: int, budget_bytes: int, model: torch.nn.Module
) -> tuple[int, bool]:
    """``(extra, over)``: the bytes fetched during ``runner``'s step (``nbytes``,
    :func:`watch_fetches`) beyond the ones its plan counts, and whether its predicted peak
    plus them is over ``budget_bytes`` (logged: a warning where over)."""
    extra = max(0, nbytes - runner.fetched_batch_bytes)
    if not extra:
        return 0, False
    over = runner.predicted_peak_bytes + extra > budget_bytes
    (log.warning if over else log.info)(
        "chkpt_opt: the loop fetched %s of another batch during this step of %s (between the "
        "forward and the backward pass), which its plan did not count%s; plans count it "
        "from now on",
        format_bytes(extra),
        type(model).__name__,
        ": this step may have peaked above the budget by up to its bytes, and the next call "
        "is planned again"
        if over
        else " (the plan still fits)",
    )
    return extra, over


def _batches_in_loop(shapes: frozenset[tuple[Any, ...]], thread: int) -> dict[int, int]:
    """Storage address -> bytes of the tensors of ``shapes`` in the variables of the loop
    running on ``thread`` that do not require grad."""
    found: dict[int, int] = {}
    if not shapes:
        return found
    for value in _loop_values(thread):
        if (
            type(value) is torch.Tensor
            and not value.requires_grad
            and (value.dtype, value.device, tuple(value.shape)) in shapes
        ):
            ptr = storage_ptr(value)
            if ptr:
                found[ptr] = value.untyped_storage().nbytes()
    return found


def _loop_values(thread: int) -> Iterator[Any]:
    """The values of the local variables of ``thread``'s frames outside the libraries, and
    the items of the containers among them, two levels deep."""
    frame = sys._current_frames().get(thread)
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if module.split(".")[0] not in _LIBRARIES:
            for value in list(frame.f_locals.values()):
                yield value
                for item in _items(value):
                    yield item
                    yield from _items(item)
        frame = frame.f_back


def _items(value: Any) -> list[Any]:
    if isinstance(value, Mapping):
        values = value.values()
    elif isinstance(value, (list, tuple)):
        values = value
    else:
        return []
    return list(values) if len(values) <= MAX_ITEMS else []
