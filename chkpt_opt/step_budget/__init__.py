"""The step's budget: what a whole training step holds besides activations, per device or per rank.

- :mod:`~chkpt_opt.step_budget.budget`: budgets parsed and formatted (``"20GB"``, ``"20GiB"``,
  ``"80%"``); resident memory (parameters, gradients, optimizer state: ``StaticMemory``);
  the one split of a step budget into the solver's activation bytes (``split_budget``).
- :mod:`~chkpt_opt.step_budget.whole_step`: the step around the solvers (resident memory for an
  optimizer name or instance, ``activation_budget``, ``solve`` and ``simulate_step`` with their
  whole-step results, the error for a budget no schedule meets). The one module here that
  imports torch (for optimizer instances), so this package's ``__init__`` does not import it.
- :mod:`~chkpt_opt.step_budget.sharding`: per-rank resident memory under FSDP2 and DDP, the
  per-rank graph a solver gets, the sharding read off wrapped models.
- :mod:`~chkpt_opt.step_budget.fsdp2_timeline`: what FSDP2 allocates along one rank's step,
  inserted into the op sequence as ``"fsdp"`` steps.
"""
