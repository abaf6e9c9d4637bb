"""Heuristics over keep-set schedules: ``keep_all``, Chen et al.'s square-root (``sqrt``)
and budget-driven greedy (``greedy``) segmentations.

Searches: a few recompute regions between low-crossing cut positions
(:mod:`chkpt_opt.solvers.segments`), each candidate judged by the simulator; the greedy
threshold sweep (:mod:`~chkpt_opt.solvers.heuristics.greedy_sweep`, not registered) is also
the warm start of the exact solvers and the start of the local searches.

Proves: nothing beyond the simulated peak and cost of the schedule returned (no bound),
except that a schedule recomputing nothing is optimal when it fits.
"""
