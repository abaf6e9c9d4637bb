"""Recompute on unpack (issue 34): which ops a schedule may unpack and what the rule adds to
the op sequence (:mod:`chkpt_opt.memory_model.unpack.rule`, pure Python). Codegen runs it through
saved-tensor hooks (:mod:`chkpt_opt.codegen.unpack`)."""

from chkpt_opt.memory_model.unpack.rule import (
    UnpackPlan,
    check_unpacked,
    rebuilt_storages,
    unpack_candidates,
    unpack_plans,
    unpack_problem,
    unpackable_ops,
)

__all__ = [
    "UnpackPlan",
    "check_unpacked",
    "rebuilt_storages",
    "unpack_candidates",
    "unpack_plans",
    "unpack_problem",
    "unpackable_ops",
]
