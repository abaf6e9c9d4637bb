"""The interval model of keep-set schedules and its integer program: what every flat solver,
the chain DP and the block solver read about a graph.

A keep-set schedule is a set of disjoint recompute regions, each an interval between two
allowed cut positions. :mod:`~chkpt_opt.solvers.interval.model` holds what such a schedule
costs and keeps at every slot, derived from the op sequence of
:func:`chkpt_opt.memory_model.op_sequence.lower`; :mod:`~chkpt_opt.solvers.interval.builder` builds
it, with the cache columns of :mod:`~chkpt_opt.solvers.interval.cache_columns` (a span once
more per set of ops it may cache); :mod:`~chkpt_opt.solvers.interval.program` states the
0/1 program any engine solves; :mod:`~chkpt_opt.solvers.interval.prepare` gets a graph ready
for it; :mod:`~chkpt_opt.solvers.interval.judge` simulates every schedule an engine returns.

Searches nothing by itself. Proves: a solution of the program is a valid schedule whose
peak and recompute time the model predicts exactly; the judge raises ``SolverError``
whenever the simulator disagrees, so a proof over the program is a proof over the
schedules it holds.
"""
