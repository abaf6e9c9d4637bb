"""Room on Python's stack for deeply nested recompute regions.

A region nested in another calls it through its body, ``nn.Module.__call__`` and
non-reentrant ``torch.utils.checkpoint``: about 9 Python frames per nesting level in the
forward pass, and 3 per level in the backward pass, where checkpoint's unpack hooks
recurse through the enclosing regions' saved inputs (measured on Python 3.11 by counting
frames in the reproducer's plans: forward, nesting 30 -> 280 frames, 60 -> 550, 500 ->
4510). The nested solver may return schedules nested ~100 deep, past the default limit
of 1000 frames. :func:`recursion_room` raises the limit for the span of a deep region's
call (its forward run, and its recomputation's body) and :func:`room_in_backward` for
the backward pass through it; the old limit comes back when the last of them ends.
Python 3.11 keeps these frames off the C stack except at C calls; a plan nested 500 deep
ran forward and backward (4510 frames) on an 8 MiB C stack, so the solvers' nesting
needs no cap.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

FRAMES_PER_LEVEL = 16
"""Frames reserved per nesting level (9 measured in the forward pass, with headroom)."""

HEADROOM_FRAMES = 400
"""Frames reserved past the deepest region, for its body's ops and their callees."""

DEEP_LEVELS = 8
"""Regions nested fewer levels deep than this leave the limit alone (they need at most
~80 frames)."""

# True inside a region whose call made room for the regions nested in it.
_ROOMY: contextvars.ContextVar[bool] = contextvars.ContextVar("chkpt_opt_roomy", default=False)

_LOCK = threading.Lock()
_requests: list[int] = []  # the limits the calls running now need
_restore: list[int] = []  # [the limit before the first of them, the limit set since]


def _stack_depth() -> int:
    frame = sys._getframe()
    depth = 0
    while frame is not None:
        depth += 1
        frame = frame.f_back
    return depth


def _ask(needed: int) -> None:
    with _LOCK:
        current = sys.getrecursionlimit()
        if not _requests:
            _restore[:] = [current, current]
        _requests.append(needed)
        if current < needed:
            sys.setrecursionlimit(needed)
            _restore[1] = needed


def _release(needed: int) -> None:
    with _LOCK:
        _requests.remove(needed)
        if _requests or not _restore:
            return
        before, set_to = _restore
        _restore.clear()
        # Left alone where someone else changed it meanwhile.
        if sys.getrecursionlimit() == set_to:
            sys.setrecursionlimit(before)


_NOTHING = contextlib.nullcontext()


def recursion_room(levels: int) -> contextlib.AbstractContextManager[None]:
    """Makes room for ``levels`` nested regions below the current frame, for the span of
    the ``with`` block (a no-op for shallow nesting and inside a region that made room).

    Thread-safe: the limit is interpreter-wide, so it stays at the highest request until
    the last running request ends, then returns to what it was before the first (unless
    changed meanwhile by other code, which then keeps its value).
    """
    if levels < DEEP_LEVELS or _ROOMY.get():
        return _NOTHING  # one check per region call: shallow plans pay nothing else
    return _room(levels)


@contextlib.contextmanager
def _room(levels: int) -> Iterator[None]:
    needed = _stack_depth() + levels * FRAMES_PER_LEVEL + HEADROOM_FRAMES
    _ask(needed)
    token = _ROOMY.set(True)
    try:
        yield
    finally:
        _ROOMY.reset(token)
        _release(needed)


def room_in_backward(outputs: Any, levels: int) -> None:
    """Makes room, in the backward pass through ``outputs`` (a region's), for its nesting.

    Called after a region's forward call, outside a region that made room (so, for the
    outermost deep region). In the backward pass checkpoint unpacks a nested region's
    inputs from its enclosing region's saved tensors, through each level's unpack hook
    (3 frames per level), before any region's body runs again: the room opens when the
    first gradient reaches the region's outputs and closes when the backward pass ends
    (a callback of autograd's engine).
    """
    if levels < DEEP_LEVELS or _ROOMY.get() or not torch.is_grad_enabled():
        return
    for leaf in tree_leaves(outputs):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            leaf.register_hook(functools.partial(_open_in_backward, levels))


def _open_in_backward(levels: int, grad: torch.Tensor) -> None:
    needed = _stack_depth() + levels * FRAMES_PER_LEVEL + HEADROOM_FRAMES
    _ask(needed)
    torch.autograd.Variable._execution_engine.queue_callback(  # type: ignore[attr-defined]
        functools.partial(_release, needed)
    )
