"""Pieces every op sequence is built from: its steps (:mod:`~chkpt_opt.sequence.steps`) and
the gradients of the backward pass (:mod:`~chkpt_opt.sequence.gradients`), shared by
:func:`chkpt_opt.op_sequence.lower` and :func:`chkpt_opt.staged.sequence.lower_staged`."""
