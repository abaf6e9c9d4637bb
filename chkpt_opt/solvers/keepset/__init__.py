"""Exact and rounded keep-set solvers over the whole schedule model: ``cpsat``, ``milp``,
``pruned``, ``lp_round``, ``enumerate``.

Searches: keep-set schedules (disjoint recompute regions between allowed cuts) through the
interval program of :mod:`chkpt_opt.solvers.interval`, given to an engine
(:mod:`chkpt_opt.solvers.engines`): every cut or a candidate subset
(:mod:`~chkpt_opt.solvers.keepset.flat`, shared by ``cpsat`` and ``milp``), every cut after exact
reductions from an incumbent (:mod:`~chkpt_opt.solvers.keepset.pruned_search`), the LP relaxation
rounded (``lp_round``), or every schedule of a tiny graph simulated (``enumerate``, the brute force
the others are tested against). The warm starts and incumbents
(:mod:`~chkpt_opt.solvers.keepset.warm_start`: the greedy sweep, the recompute bound rounded into
regions by :mod:`~chkpt_opt.solvers.keepset.bound_rounding`, the block search) are built here too.

Proves: ``optimal`` over every keep-set schedule when the program holds every allowed cut
and the engine finishes (``enumerate``: always, on the graphs it accepts); otherwise a
proven lower bound where the engine or the LP gives one.
"""
