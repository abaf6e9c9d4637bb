"""The default generators' state of a random op's forward call, replayed around its
recomputation (a staged schedule's, :mod:`chkpt_opt.codegen.staged_run`), so that it draws
the same numbers: what checkpoint's ``preserve_rng_state`` does for a region, per op. The
CPU generator's state is 5056 bytes (a copy kept per recomputed random op until its last
recomputation, one more while it runs); a CUDA generator's, its seed and offset, is copied
to the host."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

RngStates = list[tuple[torch.device, torch.Tensor]]
"""The states of the default generators of some devices (the CPU's, a CUDA device's)."""


def rng_states(devices: list[torch.device]) -> RngStates:
    """The default generators' states of ``devices``, copied."""
    return [
        (d, torch.get_rng_state() if d.type == "cpu" else torch.cuda.get_rng_state(d))
        for d in devices
    ]


def _set_rng_states(states: RngStates) -> None:
    for device, state in states:
        if device.type == "cpu":
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, device)


@contextlib.contextmanager
def rng_replayed(states: RngStates | None) -> Iterator[None]:
    """The default generators set to ``states`` (a random op's forward call's) for the span
    of its recomputation, and put back after it (nothing where ``states`` is None)."""
    if states is None:
        yield
        return
    own = rng_states([d for d, _ in states])
    _set_rng_states(states)
    try:
        yield
    finally:
        _set_rng_states(own)
