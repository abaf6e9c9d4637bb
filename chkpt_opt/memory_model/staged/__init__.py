"""Staged recomputation (issue 34): general rematerialization that PyTorch executes.

A *staged* schedule says, for each backward op, which forward ops are recomputed just before
it runs; every value (the forward's, or a recomputation's) is kept from where it is computed
to its last use: a forward reader, a recomputation that reads it, or a backward op that
unpacks it, each use taking the latest value computed before it. This is the space of
Checkmate's program (Jain et al. 2020) without recomputation in the forward pass, which
eager autograd cannot run. A schedule of regions, cached and unpacked ops recomputes some
forward ops before some backward ops; as a staged schedule
(:func:`~chkpt_opt.memory_model.staged.translate.as_staged`) it does the same work and keeps at most
as much where the ops it recomputes draw no random numbers (a region replays dropout with its
RNG state; a stage does not recompute it): ``tests/memory_model/staged``. PyTorch runs it through
saved-tensor hooks: a saved tensor whose use takes a recomputed value is packed as a handle,
and a pre-hook on the backward node recomputes the stage's ops from the values kept
(:mod:`chkpt_opt.codegen.staged`); an op that saves a buffer of its own (a max-pool's
indices) is recomputed with autograd recording, which hands its saved buffers over.

:mod:`~chkpt_opt.memory_model.staged.rule` checks a staged schedule;
:mod:`~chkpt_opt.memory_model.staged.sequence` lowers it to the op sequence the simulator reads (the
one memory model).
"""

from chkpt_opt.memory_model.staged.rule import check_staged, recomputable_ops, staged_schedule

__all__ = ["check_staged", "recomputable_ops", "staged_schedule"]
