"""The solver registry: solvers found by name.

Example:
    >>> "greedy" in available_solvers()
    True
    >>> get_solver("sqrt").name
    'sqrt'
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from chkpt_opt.errors import SolverError
from chkpt_opt.solvers.base import Solver

_REGISTRY: dict[str, Callable[..., Solver]] = {}
_DESCRIPTIONS: dict[str, str] = {}


def register(
    name: str, description: str
) -> Callable[[Callable[..., Solver]], Callable[..., Solver]]:
    """Class decorator that registers a solver factory under ``name``."""

    def wrap(factory: Callable[..., Solver]) -> Callable[..., Solver]:
        if name in _REGISTRY:
            raise SolverError(f"solver name {name!r} is registered twice.")
        _REGISTRY[name] = factory
        _DESCRIPTIONS[name] = description
        return factory

    return wrap


def available_solvers() -> dict[str, str]:
    """Names of the registered solvers, with a one-line description of each."""
    _load_builtin()
    return dict(sorted(_DESCRIPTIONS.items()))


def get_solver(name: str | Solver, **settings: Any) -> Solver:
    """Returns the solver registered as ``name``, built with ``settings``.

    A solver value passed instead of a name is returned unchanged.

    Raises:
        SolverError: for an unknown name (the message lists the known ones).
    """
    if not isinstance(name, str):
        return name
    _load_builtin()
    if name in _UNAVAILABLE:
        raise SolverError(
            f"solver {name!r} needs OR-Tools, which cannot be imported here "
            f"({_UNAVAILABLE[name]}); install it with `pip install ortools`, or use "
            "'greedy' or 'sqrt'."
        )
    try:
        factory = _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise SolverError(f"solver {name!r} is unknown; available solvers: {known}.") from None
    try:
        return factory(**settings)
    except TypeError as err:
        raise SolverError(
            f"solver {name!r} does not take settings {sorted(settings)}: {err}"
        ) from None


def solver_settings(*, gap: float | None, stall_s: float | None) -> dict[str, float]:
    """The settings a caller gave for :func:`get_solver` (``gap``, ``stall_s``: None is not
    given), leaving the others to the solver's defaults."""
    given = {"gap": gap, "stall_s": stall_s}
    return {name: value for name, value in given.items() if value is not None}


_BUILTIN: dict[str, str] = {
    # solver name -> the module that registers it
    "keep_all": "chkpt_opt.solvers.heuristics.keep_all",
    "greedy": "chkpt_opt.solvers.heuristics.greedy",
    "sqrt": "chkpt_opt.solvers.heuristics.sqrt",
    "enumerate": "chkpt_opt.solvers.keepset.enumerate",
    "auto": "chkpt_opt.solvers.auto",
    "cpsat": "chkpt_opt.solvers.keepset.cpsat",
    "milp": "chkpt_opt.solvers.keepset.milp",
    "lp_round": "chkpt_opt.solvers.keepset.lp_round",
    "hierarchical": "chkpt_opt.solvers.blocks.hierarchical",
    "dp_chain": "chkpt_opt.solvers.chain.dp_chain",
    "pruned": "chkpt_opt.solvers.keepset.pruned",
    "nested": "chkpt_opt.solvers.nested.shape_search",
    "cached": "chkpt_opt.solvers.cached.local_search",
    "dp_nested": "chkpt_opt.solvers.nested.dp_nested",
    "milp_cached": "chkpt_opt.solvers.cached.milp_cached",
    "staged": "chkpt_opt.solvers.staged.exact",
}
_UNAVAILABLE: dict[str, str] = {}
"""Solver name -> why its module cannot be imported here (OR-Tools missing)."""


def _load_builtin() -> None:
    # Importing the modules registers their solvers. The exact solvers need OR-Tools; on a
    # machine without it they are reported unavailable and the others still work.
    for name, module in _BUILTIN.items():
        if name in _REGISTRY or name in _UNAVAILABLE:
            continue
        try:
            importlib.import_module(module)
        except ImportError as err:
            if "ortools" not in str(err):
                raise
            _UNAVAILABLE[name] = str(err)
