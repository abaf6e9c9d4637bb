"""The bytes alive at every step of an op sequence, and when each instance lives, as the
separator chain (:mod:`~chkpt_opt.solvers.nested.separator_chain`) and the block options
(:mod:`~chkpt_opt.solvers.nested.unit_options`) read them off
:func:`chkpt_opt.memory_model.op_sequence.lower`: the simulator's count, less the forward
instances of a chain's broadcast storages (pinned: the DP counts them at every step)."""

from __future__ import annotations

from dataclasses import dataclass

from chkpt_opt.memory_model.op_sequence import Step
from chkpt_opt.memory_model.simulate import step_bytes


@dataclass(frozen=True)
class Timeline:
    """Bytes alive at every step of an op sequence and when each instance lives."""

    during: list[int]
    after: list[int]
    born: dict[str, int]
    dies: dict[str, int]

    def alive(self, instance: str, position: int, *, after: bool = False) -> bool:
        """Whether ``instance`` is alive while the step at ``position`` runs (``after``:
        once it is done)."""
        dies = self.dies.get(instance, -1)
        return self.born.get(instance, 1 << 62) <= position and (
            position < dies if after else position <= dies
        )


def timeline(steps: list[Step], pinned: frozenset[str] = frozenset()) -> Timeline:
    """The bytes of every step, as :func:`chkpt_opt.memory_model.simulate.simulate` counts them,
    less the forward instances of the ``pinned`` storages
    (:func:`~chkpt_opt.solvers.nested.separator_chain.broadcast_storages`)."""
    born: dict[str, int] = {}
    dies: dict[str, int] = {}
    during: list[int] = []
    after: list[int] = []
    pinned_insts = {f"f:{sid}" for sid in pinned}
    pinned_sizes: dict[str, int] = {}
    for position, (step, alive_during, alive_after) in enumerate(step_bytes(steps)):
        for inst, nbytes in step.alloc:
            born[inst] = position
            if inst in pinned_insts:
                pinned_sizes[inst] = nbytes
        pinned_alive = sum(pinned_sizes.values())
        for inst in step.free:
            dies[inst] = position
            pinned_sizes.pop(inst, None)
        during.append(alive_during - pinned_alive)
        after.append(alive_after - sum(pinned_sizes.values()))
    for inst in born:
        dies.setdefault(inst, len(steps))  # held to the end of the step
    return Timeline(during, after, born, dies)
