"""Pieces every op sequence is built from: its steps (:mod:`~chkpt_opt.memory_model.sequence.steps`)
and the gradients of the backward pass (:mod:`~chkpt_opt.memory_model.sequence.gradients`), shared
by
:func:`chkpt_opt.memory_model.op_sequence.lower` and
:func:`chkpt_opt.memory_model.staged.sequence.lower_staged`."""
