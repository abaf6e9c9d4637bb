"""Schedules with cached ops: one level of regions, each caching some of its ops' outputs
(a selective-checkpoint ``MUST_SAVE``) instead of recomputing them; ``milp_cached``
(exact) and ``cached`` (a local search).

Searches: ``milp_cached`` (:mod:`~chkpt_opt.solvers.cached.milp_cached`) solves the interval
program over cache columns (a region span once more per set of its ops it may cache) with
the MILP engine, from the keep-set optimum; ``cached``
(:mod:`~chkpt_opt.solvers.cached.local_search`) walks from a schedule to its best
neighbour (an op of a region cached or not, a region's boundary moved, a region opened),
every neighbour judged by the simulator;
:mod:`~chkpt_opt.solvers.cached.cache_rounding` rounds the recompute bound's LP into
regions that cache what it keeps (and the model's own layers caching their costliest
ops): where ``auto`` starts beyond keep-set.

Proves: ``milp_cached`` is ``optimal`` over one-level schedules whose regions each cache
one of the model's sets (``stats["optimal_over"]``), never costlier than the keep-set
optimum; the local search and the rounding prove nothing (feasible or not, no bound).
"""
