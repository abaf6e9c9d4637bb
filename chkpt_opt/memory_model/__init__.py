"""The memory model: what a schedule is, and what memory and compute it costs.

Pure Python (networkx at most); the solvers, codegen and the step's budget read it, and it
reads only :mod:`chkpt_opt.graphs` (the cost graph) and :mod:`chkpt_opt.errors`.

- :mod:`~chkpt_opt.memory_model.schedule`: the Schedule (keep-set regions, nested regions,
  cached ops, unpacked ops, stages), its validity check, region tree and cut positions.
- :mod:`~chkpt_opt.memory_model.schedule_io`: schedule files (versions 1-4) and their checks.
- :mod:`~chkpt_opt.memory_model.op_sequence`: ``lower``, the op sequence PyTorch executes under a
  schedule (compute, free, backward steps): the single memory rule set.
- :mod:`~chkpt_opt.memory_model.sequence`: the steps every op sequence is built from, and the
  gradients of the backward pass.
- :mod:`~chkpt_opt.memory_model.region_replay`: what a region's replay runs and keeps.
- :mod:`~chkpt_opt.memory_model.unpack`: recompute on unpack (which ops, what the rule adds).
- :mod:`~chkpt_opt.memory_model.staged`: staged schedules (their rule, op sequence, and any
  schedule translated into one).
- :mod:`~chkpt_opt.memory_model.simulate`: the simulator over the op sequence, the one
  reference for predicted peak and compute cost.
- :mod:`~chkpt_opt.memory_model.replay_cost`: the compute a schedule's recomputation adds.
"""
