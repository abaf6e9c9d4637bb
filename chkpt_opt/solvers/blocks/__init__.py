"""``solver="hierarchical"``: keep-set schedules of graphs made of repeated blocks
(transformer layers, ResNet stages), solved block by block.

Searches: keep-set schedules whose regions each stay inside one segment (prologue, a
repeated block, epilogue; :mod:`~chkpt_opt.solvers.blocks.repeated` finds them and splits
the interval model's memory by segment). One CP-SAT program per distinct block gives its
options (recompute, own peak, kept bytes: :mod:`~chkpt_opt.solvers.blocks.options`), a DP
over the chain of blocks picks one per block and a final polish revisits them all
(:mod:`~chkpt_opt.solvers.blocks.search`).

Proves: nothing over the whole keep-set space (its regions stay inside blocks): the result
is feasible or not, never ``optimal``; every schedule is simulated and the prediction
checked. The block search is also part of the pruned search's incumbent.
"""
