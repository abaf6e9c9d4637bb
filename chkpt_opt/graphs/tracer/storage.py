"""Exact accounting of tensor storages, at the level of the PyTorch dispatcher.

:class:`StorageTracker` is a dispatch mode that sees every tensor an ATen op returns, in
the forward pass and in the backward pass (the autograd engine runs under the same mode),
and counts each new storage once, from the moment it is created until its last reference
dies (a weak-reference finalizer). It works on real tensors and on fake tensors alike, so
the tracer measures ops on fake tensors with the same ruler that validation uses on real
ones.

Allocations that a kernel makes internally and frees before returning are not visible to
it; the measured peak is the peak of live tensor storages.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class StorageTracker(TorchDispatchMode):
    """Tracks live bytes of the storages created while the mode is active.

    Example:
        >>> x = torch.randn(256, 256, requires_grad=True)
        >>> with StorageTracker() as tracker:
        ...     y = (x * 2).relu().sum()
        ...     y.backward()
        >>> tracker.peak_bytes >= 2 * 256 * 256 * 4
        True
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._sizes: dict[int, int] = {}

    def reset_peak(self) -> None:
        """Starts a new peak measurement from the bytes alive now."""
        self.peak_bytes = self.live_bytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            key
            for value in tree_flatten((args, kwargs))[0]
            if isinstance(value, torch.Tensor) and (key := _storage_key(value)) is not None
        }
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._track(value, inputs)
        return out

    def _track(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        key = _storage_key(tensor)
        # A view or in-place result of an input is not a new storage, even when the input
        # was created before tracking began (parameters, inputs).
        if key is None or key in self._sizes or key in inputs:
            return
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        self._sizes[key] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        nbytes = self._sizes.pop(key, None)
        if nbytes is not None:
            self.live_bytes -= nbytes

    def is_tracked(self, tensor: torch.Tensor) -> bool:
        """Whether the storage of ``tensor`` was created under this tracker."""
        return _storage_key(tensor) in self._sizes


class ResizingStorageTracker(StorageTracker):
    """A :class:`StorageTracker` that also sees storages change size in place.

    ``untyped_storage().resize_()`` is no ATen op, so a dispatch mode never sees it; FSDP2
    allocates and frees its unsharded parameters that way (``alloc_storage``,
    ``free_storage``). This tracker sums the current size of every storage it tracks at
    every op (slower: for small models), and ``watch`` adds storages made before it began
    whose size may change (FSDP2's all-gather outputs of an earlier step, empty between
    steps).
    """

    def __init__(self, watch: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._storages: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        for tensor in watch:
            storage = tensor.untyped_storage()
            self._storages[id(storage)] = weakref.ref(storage)
        self.live_bytes = self.peak_bytes = self._current_bytes()

    def _track(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        super()._track(tensor, inputs)
        key = _storage_key(tensor)
        if key is None or key not in self._sizes:
            return
        known = self._storages.get(key)
        if known is None or known() is None:  # new, or a dead storage's id reused
            self._storages[key] = weakref.ref(tensor.untyped_storage())

    def _current_bytes(self) -> int:
        total = 0
        for key, ref in list(self._storages.items()):
            storage = ref()
            if storage is None:
                del self._storages[key]
            else:
                total += storage.nbytes()
        return total

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.live_bytes = self._current_bytes()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return out

    def _release(self, key: int) -> None:
        self._sizes.pop(key, None)


def _storage_key(tensor: torch.Tensor) -> int | None:
    try:
        return id(tensor.untyped_storage())
    except (NotImplementedError, RuntimeError):  # sparse or storage-less tensors
        return None
