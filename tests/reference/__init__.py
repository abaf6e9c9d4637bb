"""Reference computations the tests compare the solvers with; none is a registered solver.

* :mod:`~tests.reference.revolve`: Griewank's binomial checkpointing on
  homogeneous chains (multi-level schedules, outside the keep-set model);
* :mod:`~tests.reference.bounds`: the smallest feasible budget of a graph and
  the most memory checkpointing can save, as typed values read from
  ``chkpt_opt.smallest_peak`` (the lowest peak the registered solvers find; what users call).
"""
