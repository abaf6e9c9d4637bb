"""Measuring one rank's memory under FSDP2 on CPU, for the sharded tests: the local bytes
of sharded tensors, and the storages FSDP2 resizes in place between steps."""

from __future__ import annotations

import torch

TOLERANCE = 0.03
"""How far a predicted per-rank peak may be from the measured one (issue 35)."""


def local_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors`` on this rank (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    return sum(
        (t.to_local() if isinstance(t, DTensor) else t).untyped_storage().nbytes() for t in tensors
    )


def gathered_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The per-parameter all-gather outputs FSDP2 keeps across steps, resized to nothing
    while sharded and back to full size at each all-gather (no ATen op sees that): a
    :class:`~chkpt_opt.graphs.tracer.storage.ResizingStorageTracker` must watch them."""
    from torch.distributed.fsdp import FSDPModule

    found = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for param in group.fsdp_params:
                    found += [*param.all_gather_outputs, *param._unsharded_inner_tensors]
    return found


def close(predicted: int, measured: int) -> bool:
    """Whether ``predicted`` is within :data:`TOLERANCE` of ``measured``."""
    return abs(predicted - measured) <= TOLERANCE * measured


def layerwise_facts(name: str, model: torch.nn.Module) -> dict[str, object]:
    """What the layer-wise attachment on ``model`` planned, keyed ``<name>_<fact>``: the
    layers it checkpoints, its predicted per-rank peak, their policies, the extra compute
    and its summary (read back by the test process)."""
    import chkpt_opt

    attached = chkpt_opt.attachment_of(model)
    assert attached is not None, f"{name}: optimize() attached nothing"
    return {
        f"{name}_layers": list(attached.layer_paths),  # type: ignore[attr-defined]
        f"{name}_predicted": attached.predicted_peak_bytes,  # type: ignore[attr-defined]
        f"{name}_policies": attached.policies,  # type: ignore[attr-defined]
        f"{name}_overhead": attached.overhead,  # type: ignore[attr-defined]
        f"{name}_summary": attached.summary(),
    }
