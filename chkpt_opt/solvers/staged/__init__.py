"""Solvers of staged schedules (:mod:`chkpt_opt.memory_model.staged`): per-stage recomputation
decided op by op. :mod:`~chkpt_opt.solvers.staged.exact` solves Checkmate's program over it
(``solver="staged"``)."""
