"""The recompute bound's row check in numpy (:func:`row_excess`): how far one step's memory
row of :mod:`~chkpt_opt.solvers.bounds.recompute_bound` is over the budget at the LP's
solution.

The check sets every ``d`` at its op's ``r`` and every ``a`` as low as the row's
constraints allow: a kept storage alive with ``1 - r[owner]``, a storage a recomputation
reads alive with at least ``r[reader] - r[owner]``. Each row's storages, owners and reads are
index arrays built once (:class:`RowArrays`, by
:class:`~chkpt_opt.solvers.bounds.bound_rows.KeepAllRows`), and a round is a few array
operations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class RowArrays:
    """One row's storages and reads as indices (ops by their topological position).

    Attributes:
        sizes: bytes of each storage the row counts (its kept storages first).
        kept: how many of ``sizes`` are kept storages.
        kept_owner: the owner op of each kept storage.
        read_storage: for each read of a recomputation, the storage's index in ``sizes``.
        read_op: the op that reads it.
        read_owner: the storage's owner op.
        ops: the ops of the closure (those a recomputation after the step may run).
    """

    sizes: npt.NDArray[np.float64]
    kept: int
    kept_owner: npt.NDArray[np.int64]
    read_storage: npt.NDArray[np.int64]
    read_op: npt.NDArray[np.int64]
    read_owner: npt.NDArray[np.int64]
    ops: npt.NDArray[np.int64]


def row_excess(row: RowArrays, r: npt.NDArray[np.float64], room_bytes: int) -> float:
    """Bytes by which ``row`` is over ``room_bytes`` at the recompute shares ``r`` (by op
    index); a storage larger than the room counts in full where any share of it is alive
    (the LP holds it dead)."""
    alive = np.zeros(len(row.sizes))
    alive[: row.kept] = 1.0 - r[row.kept_owner]
    if len(row.read_storage):
        np.maximum.at(alive, row.read_storage, r[row.read_op] - r[row.read_owner])
    excess = float(row.sizes @ alive) - room_bytes
    big = row.sizes > room_bytes
    forced = float(row.sizes[big] @ alive[big]) if big.any() else 0.0
    return max(excess, forced)
