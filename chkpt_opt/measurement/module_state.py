"""A module's state kept across a run that must not change it: buffers, gradients, RNG."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def preserved_state(module: torch.nn.Module) -> Iterator[None]:
    """Restores buffers, gradients and the RNG states (CPU and every CUDA device) of
    ``module`` on exit."""
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    grads = {
        name: (p.grad.detach().clone() if p.grad is not None else None)
        for name, p in module.named_parameters()
    }
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in module.named_buffers():
                b.copy_(buffers[name])
            for name, p in module.named_parameters():
                p.grad = grads[name]
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
