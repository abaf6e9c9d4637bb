"""The steps of an op sequence (:func:`chkpt_opt.memory_model.op_sequence.lower`): what each
allocates, frees and needs while it runs, assembled from the instances' positions by
:func:`steps_of`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    """One step of the op sequence.

    Attributes:
        kind: ``"fwd"``, ``"recompute"``, ``"bwd_start"`` (output gradients appear), ``"bwd"``,
            or ``"accumulate"`` (a gradient is added to an existing one).
        node: the op (empty for ``bwd_start``).
        alloc: ``(instance id, bytes)`` of the storages this step creates.
        free: instance ids released once this step is done.
        transient_bytes: extra bytes alive only while the step runs.
        region: for a ``"recompute"`` step, the position in
            :func:`~chkpt_opt.memory_model.schedule.region_tree` of the region whose recomputation
            runs it (-1 for the rebuild of an unpacked op).
    """

    kind: str
    node: str
    alloc: tuple[tuple[str, int], ...]
    free: tuple[str, ...]
    transient_bytes: int
    region: int = -1


def steps_of(
    kinds: list[tuple[str, str, int]],
    alloc_at: dict[str, tuple[int, int]],
    release: dict[str, int],
    transient: list[int],
) -> list[Step]:
    """The steps ``(kind, op, region)`` with the storage instances each allocates
    (``alloc_at``: instance -> (position, bytes)) and frees (after ``release[instance]``,
    never for one held to the end), and their transient bytes."""
    end = len(kinds)
    allocs: list[list[tuple[str, int]]] = [[] for _ in range(end)]
    frees: list[list[str]] = [[] for _ in range(end)]
    for inst, (position, nbytes) in alloc_at.items():
        allocs[position].append((inst, nbytes))
        last = max(release.get(inst, position), position)
        if last < end:
            frees[last].append(inst)
    return [
        Step(kind, n, tuple(sorted(allocs[p])), tuple(sorted(frees[p])), transient[p], k)
        for p, (kind, n, k) in enumerate(kinds)
    ]
