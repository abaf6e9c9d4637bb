"""``solver="dp_chain"``: keep-set schedules of a graph cut into a chain of segments, by
exact dynamic programming (Beaumont et al.'s chain DP, for the keep-set model).

Searches: every keep-set schedule whose regions begin and end at the cuts of the chain
(:mod:`~chkpt_opt.solvers.chain.cuts`: allowed cut positions where each storage whose life
depends on the schedule spans at most two adjacent segments), with the memory of every
slot as the interval model counts it (:mod:`~chkpt_opt.solvers.chain.layout`,
:mod:`~chkpt_opt.solvers.chain.model`, evaluated with the range maxima and incremental
replays of :mod:`~chkpt_opt.solvers.chain.replay`).

Proves: optimality over every keep-set schedule when the chain holds every allowed cut
position (a chain of ops; a DAG cut only at its articulation points); over the thinned cut
set otherwise, never reported ``optimal`` then. The schedule is simulated and the
prediction checked.
"""
