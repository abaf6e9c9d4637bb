"""Bounds, and the searches they prove things with: nothing here is a registered solver.

* :mod:`~chkpt_opt.solvers.bounds.recompute_bound`: an LP over the storages of the keep-all
  op sequence; a lower bound on the extra compute of every schedule (keep-set, nested or
  caching) at a budget, and a floor under every schedule's peak; its rows, one per step of
  the keep-all sequence with the ops a recomputation after the step may run, come from
  :mod:`~chkpt_opt.solvers.bounds.bound_rows` (closures of a block of steps at once) and
  are checked by :mod:`~chkpt_opt.solvers.bounds.row_check`;
* :mod:`~chkpt_opt.solvers.bounds.reductions`: exact reductions of the every-cut interval
  program from an incumbent (cost cap, reduced-cost fixing from its LP relaxation's bound);
* :mod:`~chkpt_opt.solvers.bounds.general_milp`: Checkmate's MILP over per-op recompute
  decisions per stage (general rematerialization), its memory rows counting only what every
  execution of the same decisions holds: a lower bound over every schedule PyTorch runs;
* :mod:`~chkpt_opt.solvers.bounds.lowest_peak`: the lowest-peak keep-set schedule of a
  prepared graph, proven lowest when the program holds every cut and the engine finishes.

Searches: LP relaxations and a min-peak program. Proves: lower bounds (on recompute time,
on peak) that the front-ends and ``auto`` report, and reductions that remove no optimal
schedule.
"""
