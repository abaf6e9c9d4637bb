"""Codegen: rewrites a captured fx graph so that it runs a schedule.

Each recompute region is outlined into a body GraphModule and called through
non-reentrant ``torch.utils.checkpoint``:

* the body takes every value it reads from outside as an argument (parameters and buffers
  included), so it always sees the module's current tensors;
* a region that may draw random numbers replays the RNG state (``preserve_rng_state``),
  so dropout draws the same numbers; one that draws none keeps no copy of that state
  (:mod:`~chkpt_opt.codegen.randomness`);
* ops that update module state (batch-norm running statistics, in-place updates of
  buffers such as ``num_batches_tracked``) leave that state alone while the region is
  recomputed (:class:`StateGuard`), so the state is updated exactly once per step;
* a region that reads state (a buffer, or a model input) which an in-place op updates
  later in the step would see the updated value when it is recomputed: it keeps a copy of
  that state as it was when the region ran, and its recomputation runs on a private copy
  of it (:func:`~chkpt_opt.codegen.state.snapshot_roots`);
* random ops that draw from an explicit ``torch.Generator`` (which checkpoint's
  ``preserve_rng_state`` does not cover) get that generator's state replayed too;
* under ``torch.compile`` the regions are plain non-reentrant checkpoints: AOT autograd
  recomputes them functionally, so module state is updated once without the guards.

The returned module is a new GraphModule; the model passed to ``plan``/``optimize`` is not
modified, and the new module shares its Parameter and buffer objects.

The package is split by responsibility: :mod:`~chkpt_opt.codegen.runtime` runs inside the
training step (recompute flag, state guards, :class:`CheckpointRegion`, generator replay),
:mod:`~chkpt_opt.codegen.state` analyses the module state a region reads or writes, and
:mod:`~chkpt_opt.codegen.rewrite` outlines the regions (:func:`rewrite_module`). Unpacked
ops run under the saved-tensor hooks of :mod:`~chkpt_opt.codegen.unpack`; a staged schedule
(no regions) runs through the executor of :mod:`~chkpt_opt.codegen.staged`
(:mod:`~chkpt_opt.codegen.staged_plan`: which value every use takes;
:mod:`~chkpt_opt.codegen.staged_run`: the hooks of one step).
"""

from chkpt_opt.codegen.rewrite import rewrite_module
from chkpt_opt.codegen.runtime import (
    CheckpointRegion,
    ModuleStateGuard,
    StateGuard,
    is_recomputing,
)

__all__ = [
    "CheckpointRegion",
    "ModuleStateGuard",
    "StateGuard",
    "is_recomputing",
    "rewrite_module",
]
