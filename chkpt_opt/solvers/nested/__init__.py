"""Nested (multi-level) schedules: regions inside regions, as PyTorch's nested
non-reentrant checkpoints run them; ``dp_nested`` (exact) and ``nested`` (a heuristic).

Searches: ``dp_nested`` runs rotor's recurrence (:mod:`~chkpt_opt.solvers.nested.recurrence`,
its Pareto fronts in :mod:`~chkpt_opt.solvers.nested.fronts`, the forward pass's frame in
:mod:`~chkpt_opt.solvers.nested.top_frame`) over a chain of units
(:mod:`~chkpt_opt.solvers.nested.unit_chain`): the ops of a simple chain, or the blocks
between a graph's separators (:mod:`~chkpt_opt.solvers.nested.separator_chain`), a block
optionally running a keep-set schedule of its own
(:mod:`~chkpt_opt.solvers.nested.unit_options`). ``nested``
(:mod:`~chkpt_opt.solvers.nested.shape_search`) tries a family of region shapes (outermost
regions split into inner ones, level by level, and prefixes), each judged by the
simulator.

Proves: ``dp_nested`` is ``optimal`` over the nested schedules of a simple chain that
cache nothing, named in ``stats["optimal_over"]``; over blocks, its proofs hold over that
narrower space alone (``stats["space_proof"]``). ``nested`` proves nothing: feasible or
not, no bound.
"""
