"""Measurements on the model's device: what the tracer, on fake tensors, cannot see.

* :mod:`~chkpt_opt.measurement.op_times`: every op's forward time (roofline estimates
  replaced);
* :mod:`~chkpt_opt.measurement.workspace`: kernel workspace a CUDA op takes beyond its
  tensors;
* :mod:`~chkpt_opt.measurement.region_costs`: what a recompute region and a
  selective-checkpoint policy cost beyond their ops;
* :mod:`~chkpt_opt.measurement.driver`: :func:`measure_traced`, the one path that writes
  those three into a cost graph (``chkpt_opt.trace``, ``plan`` and the attachment use it);
* :mod:`~chkpt_opt.measurement.step`: one real training step, its peak memory and time
  (what ``validate`` and the benchmarks compare predictions with);
* :mod:`~chkpt_opt.measurement.module_state`: buffers, gradients and RNG kept across a
  measuring run;
* :mod:`~chkpt_opt.measurement.timed_choice`: the plan timed against the model's own
  checkpointing layouts that fit its budget; the faster runs.

It sits above the tracer and codegen (region costs run rewritten modules) and below the
api, the attachment, validation and export.
"""

from chkpt_opt.measurement.driver import measure_traced, trace_and_measure

__all__ = ["measure_traced", "trace_and_measure"]
