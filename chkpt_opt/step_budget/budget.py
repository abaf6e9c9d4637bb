"""Memory budgets: parsing, formatting, and the split of a step budget into its parts.

A budget is the peak memory of a whole training step on the device. Part of it is taken by
tensors that live through the whole step whatever the schedule (parameters, buffers, the
example inputs, optimizer state); the rest is what the schedule may use for activations,
activation gradients and parameter gradients, which are created during the step. The one
function that performs that split is :func:`split_budget`.

Example:
    >>> parse_budget("20GB").total_bytes
    20000000000
    >>> parse_budget("1.5 GiB").total_bytes
    1610612736
    >>> format_bytes(2 * 2**30)
    '2.15 GB (2.00 GiB)'
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

from chkpt_opt.errors import BudgetError, InfeasibleBudgetError
from chkpt_opt.memory_model.sequence.gradients import PARAM_GRADS_HELD

_UNITS: dict[str, int] = {
    "B": 1,
    "kB": 10**3,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}

_CASELESS_UNITS = {u.lower(): u for u in _UNITS if u != "KB"}

_ACCEPTED_FORMS = (
    'an int of bytes (e.g. 2_000_000_000), or a string with a byte unit: "20GB" (10^9 bytes), '
    '"20GiB" (2^30 bytes), also B, kB, KiB, MB, MiB, TB, TiB; or "80%" of the CUDA device memory'
)

_BUDGET_RE = re.compile(r"^\s*(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[A-Za-z]*)\s*$", re.ASCII)
_PERCENT_RE = re.compile(r"^\s*(?P<num>\d+(?:\.\d*)?|\.\d+)\s*%\s*$", re.ASCII)


@dataclass(frozen=True)
class Budget:
    """A parsed memory budget for a whole training step.

    Attributes:
        total_bytes: the peak memory allowed for the step, in bytes.
        text: the value it was parsed from, for messages.
    """

    total_bytes: int
    text: str

    def __str__(self) -> str:
        return format_bytes(self.total_bytes)


_DISPLAY_UNITS = (
    (10**9, 2**30, "GB", "GiB"),
    (10**6, 2**20, "MB", "MiB"),
    (10**3, 2**10, "kB", "KiB"),
)


def format_bytes(num_bytes: float, *, extra_digits: int = 0) -> str:
    """Formats a byte count in a decimal and the matching binary unit, as every printed
    budget shows them: GB and GiB from 0.1 GB up (two decimals), MB and MiB from 0.1 MB,
    kB and KiB from 0.1 kB (three significant digits), plain bytes below; each figure
    with ``extra_digits`` more (see :func:`format_bytes_pair`).

    Example:
        >>> format_bytes(20 * 10**9), format_bytes(35_000)
        ('20.00 GB (18.63 GiB)', '35 kB (34.2 KiB)')
    """
    for decimal, binary, unit, binary_unit in _DISPLAY_UNITS:
        if abs(num_bytes) >= decimal // 10:
            spec = f".{2 + extra_digits}f" if decimal == 10**9 else f".{3 + extra_digits}g"
            return (
                f"{num_bytes / decimal:{spec}} {unit} ({num_bytes / binary:{spec}} {binary_unit})"
            )
    return f"{int(num_bytes)} bytes"


def format_bytes_pair(first: float, second: float) -> tuple[str, str]:
    """Two byte counts formatted alike (:func:`format_bytes`), with as many more digits as
    make two different counts read differently in both units: a budget and the smallest
    one that fits never read ``0.10 GiB`` both.

    Example:
        >>> format_bytes_pair(104_000_000, 105_000_000)
        ('0.104 GB (0.097 GiB)', '0.105 GB (0.098 GiB)')
    """
    for extra in range(16):
        texts = format_bytes(first, extra_digits=extra), format_bytes(second, extra_digits=extra)
        (dec_a, _, bin_a), (dec_b, _, bin_b) = (text.partition(" (") for text in texts)
        if first == second or (dec_a != dec_b and bin_a != bin_b) or not bin_a:
            return texts
    return format_bytes(first), format_bytes(second)


def parse_budget(value: int | str | Budget, *, device_total_bytes: int | None = None) -> Budget:
    """Parses a budget given as bytes, a string with a unit, or a percentage of the device.

    Args:
        value: ``20_000_000_000``, ``"20GB"``, ``"20GiB"``, ``"512 MiB"``, ``"80%"``...
        device_total_bytes: total memory of the CUDA device, needed for percentages.

    Returns:
        The parsed :class:`Budget`.

    Raises:
        BudgetError: for bits (``"20Gb"``, ``"20gb"``), strings without a unit, unknown units,
            negative or zero values, and percentages without a CUDA device.
    """
    if isinstance(value, Budget):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise BudgetError(f"budget {value!r} is a {type(value).__name__}; give {_ACCEPTED_FORMS}.")
    if isinstance(value, int):
        if value <= 0:
            raise BudgetError(f"budget {value!r} must be a positive number of bytes.")
        return Budget(total_bytes=value, text=str(value))

    percent = _PERCENT_RE.match(value)
    if percent:
        fraction = float(percent.group("num")) / 100.0
        if not 0.0 < fraction <= 1.0:
            raise BudgetError(f"budget {value!r} must be a percentage in (0%, 100%].")
        if device_total_bytes is None:
            raise BudgetError(
                f"budget {value!r} is a share of the CUDA device's memory, but no CUDA device "
                'is in use; give an absolute budget such as "20GB" instead.'
            )
        return Budget(total_bytes=int(device_total_bytes * fraction), text=value)

    match = _BUDGET_RE.match(value)
    if not match:
        raise BudgetError(f"budget {value!r} cannot be read; give {_ACCEPTED_FORMS}.")
    unit = match.group("unit")
    number = Fraction(match.group("num"))  # exact: "2.01kB" is 2010 bytes, not 2009
    if not unit:
        raise BudgetError(
            f'budget {value!r} has no unit; say which one, e.g. "{value.strip()}GB" or '
            f'"{value.strip()}GiB" (or pass an int for bytes). Accepted: {_ACCEPTED_FORMS}.'
        )
    if unit not in _UNITS:
        hint = ""
        proper = _CASELESS_UNITS.get(unit.lower())
        if unit.endswith("b") and proper:
            hint = f" A lowercase 'b' means bits; for bytes write {proper}."
        elif proper:
            hint = f" Did you mean {proper}?"
        raise BudgetError(
            f"budget {value!r} has unknown unit {unit!r}.{hint} Give {_ACCEPTED_FORMS}."
        )
    total = math.floor(number * _UNITS[unit])
    if total < 1:
        raise BudgetError(f"budget {value!r} must be at least one byte.")
    return Budget(total_bytes=total, text=value)


@dataclass(frozen=True)
class StaticMemory:
    """Memory that lives through the whole training step, whatever the schedule.

    Attributes:
        param_bytes: parameters (all of them, trainable or frozen).
        buffer_bytes: module buffers (batch-norm statistics, ...).
        input_bytes: the example inputs of the step.
        optimizer_state_bytes: optimizer state (AdamW: two states per trainable parameter).
        grad_bytes: gradients of the trainable parameters. They are created during the
            backward pass, so the simulator places them in time; they are listed here so that
            reports can show them, and are not subtracted by :func:`split_budget`.
        optimizer_step_extra_bytes: temporaries allocated by one optimizer step beyond its
            state, measured on fake tensors; with the gradients they bound the memory of the
            optimizer phase of the step.
        resident_grad_bytes: the part of ``grad_bytes`` counted resident rather than placed
            in time by the simulator (sharded gradients under FSDP2, DDP's buckets when
            gradients are views of them, gradients held from the step's start under
            gradient accumulation; else 0).
        communication_bytes: per-rank memory of sharded training beyond the states: FSDP2's
            unsharded parameters of the units alive at once and one unit's unsharded
            gradients with its reduce-scatter buffer, DDP's gradient buckets (see
            :mod:`chkpt_opt.step_budget.sharding`); 0 on one device.
        world_size: ranks the states are split over (1: one device, or DDP's replicas).
        strategy: ``"fsdp2"``, ``"ddp"``, or None on one device.
    """

    param_bytes: int
    buffer_bytes: int
    input_bytes: int
    optimizer_state_bytes: int
    grad_bytes: int
    optimizer_step_extra_bytes: int = 0
    resident_grad_bytes: int = 0
    communication_bytes: int = 0
    world_size: int = 1
    strategy: str | None = None

    @property
    def resident_bytes(self) -> int:
        """Bytes resident for the whole step (subtracted from the budget)."""
        return (
            self.param_bytes
            + self.buffer_bytes
            + self.input_bytes
            + self.optimizer_state_bytes
            + self.resident_grad_bytes
            + self.communication_bytes
        )

    @property
    def optimizer_phase_bytes(self) -> int:
        """Peak bytes above the resident ones while the optimizer steps (grads + temporaries)."""
        if self.optimizer_state_bytes == 0 and self.optimizer_step_extra_bytes == 0:
            return 0
        return self.grad_bytes - self.resident_grad_bytes + self.optimizer_step_extra_bytes

    def describe_resident(self) -> str:
        """The resident parts in words, as every printed split shows them (per rank where
        the step is sharded)."""
        parts = [
            f"parameters {format_bytes(self.param_bytes)}",
            f"optimizer state {format_bytes(self.optimizer_state_bytes)}",
        ]
        if self.resident_grad_bytes:
            parts.append(f"gradients {format_bytes(self.resident_grad_bytes)}")
        if self.strategy == "fsdp2":
            parts.append(f"unsharded units {format_bytes(self.communication_bytes)}")
        elif self.strategy == "ddp":
            parts.append(f"gradient buckets {format_bytes(self.communication_bytes)}")
        parts.append(f"buffers+inputs {format_bytes(self.buffer_bytes + self.input_bytes)}")
        where = (
            f"per rank of {self.world_size}, {self.strategy}; " if self.strategy is not None else ""
        )
        return f"{where}{', '.join(parts)}"

    def step_peak_bytes(self, peak_bytes: int) -> int:
        """The peak of the whole training step when the forward and backward passes peak at
        ``peak_bytes`` (what the solvers and the simulator report): the resident bytes plus
        the larger of that peak and the optimizer phase. The inverse of
        :func:`split_budget`: a schedule fits a step budget exactly when this is at most
        the budget.

        Example:
            >>> s = StaticMemory(param_bytes=100, buffer_bytes=0, input_bytes=10,
            ...                  optimizer_state_bytes=200, grad_bytes=100)
            >>> s.step_peak_bytes(1000), s.step_peak_bytes(50)
            (1310, 410)
        """
        return self.resident_bytes + max(peak_bytes, self.optimizer_phase_bytes)


def split_budget(budget: Budget, static: StaticMemory) -> int:
    """Returns the bytes a schedule may use for the forward and backward passes.

    This is the one place where a step budget is split: parameters, buffers, the inputs and
    the optimizer state are subtracted. What remains bounds the simulated peak of the
    forward and backward passes (activations, their gradients, and parameter gradients as
    the backward pass creates them).

    Raises:
        InfeasibleBudgetError: when the resident memory alone, or the optimizer phase, exceeds
            the budget (no schedule can help).
    """
    resident = static.resident_bytes
    dynamic = budget.total_bytes - resident
    if dynamic <= 0:
        raise InfeasibleBudgetError(
            f"budget {budget.text!r} = {format_bytes(budget.total_bytes)} is below the memory "
            f"that lives through the whole step, {format_bytes(resident)} "
            f"({static.describe_resident()}); no schedule can help. "
            "Raise the budget, use a lighter optimizer, or shard the parameters.",
            budget_bytes=budget.total_bytes,
            min_feasible_bytes=None,
        )
    if static.optimizer_phase_bytes > dynamic:
        raise InfeasibleBudgetError(
            f"budget {budget.text!r} = {format_bytes(budget.total_bytes)} cannot hold the "
            f"optimizer step: resident {format_bytes(resident)} plus gradients and optimizer "
            f"temporaries {format_bytes(static.optimizer_phase_bytes)}. Checkpointing does not "
            "change that phase; raise the budget or choose a lighter optimizer.",
            budget_bytes=budget.total_bytes,
            min_feasible_bytes=None,
        )
    return dynamic


@dataclass(frozen=True)
class OptimizerSpec:
    """How much memory an optimizer keeps per trainable parameter.

    Attributes:
        name: optimizer name.
        state_copies: state tensors per parameter, each the size of the parameter.
        step_tensor_bytes: bytes of the per-parameter step counter (Adam keeps a float32
            scalar tensor).
        foreach_extra_copies: temporaries of one ``foreach`` step (PyTorch's default on
            CUDA), in copies of all trainable parameters (AdamW: ``sqrt(exp_avg_sq)``).
        single_extra_copies: temporaries of one per-tensor step (the default on CPU), in
            copies of the largest parameter (AdamW: ``sqrt(exp_avg_sq)`` and its quotient).
    """

    name: str
    state_copies: int
    step_tensor_bytes: int = 0
    foreach_extra_copies: int = 0
    single_extra_copies: int = 0


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec("adamw", 2, 4, foreach_extra_copies=1, single_extra_copies=2),
    "adam": OptimizerSpec("adam", 2, 4, foreach_extra_copies=1, single_extra_copies=2),
    "adamw_amsgrad": OptimizerSpec(
        "adamw_amsgrad", 3, 4, foreach_extra_copies=1, single_extra_copies=2
    ),
    "sgd": OptimizerSpec("sgd", 0),
    "sgd_momentum": OptimizerSpec("sgd_momentum", 1, foreach_extra_copies=1, single_extra_copies=1),
    "rmsprop": OptimizerSpec("rmsprop", 1, 4, foreach_extra_copies=1, single_extra_copies=2),
    "adagrad": OptimizerSpec("adagrad", 1, 4, foreach_extra_copies=1, single_extra_copies=1),
}


def optimizer_spec(name: str | None) -> OptimizerSpec | None:
    """The spec of an optimizer given by name (``None``: no optimizer state is counted).

    Raises:
        BudgetError: for an unknown name, listing the known ones.
    """
    if name is None:
        return None
    key = name.lower()
    if key not in OPTIMIZERS:
        raise BudgetError(
            f"optimizer {name!r} is unknown; use one of {sorted(OPTIMIZERS)}, None for no "
            "optimizer state, or pass the torch.optim optimizer instance itself."
        )
    return OPTIMIZERS[key]


def static_memory(
    *,
    param_bytes: int,
    trainable_param_bytes: int,
    buffer_bytes: int,
    input_bytes: int,
    n_trainable_tensors: int = 0,
    largest_param_bytes: int | None = None,
    optimizer: OptimizerSpec | None,
    foreach: bool = False,
    grads_held: bool = False,
) -> StaticMemory:
    """Computes the resident memory of a training step (the one documented formula).

    ``grads_held``: the step starts with the parameters' gradients alive (gradient
    accumulation after the first micro-batch, ``zero_grad(set_to_none=False)``), so they
    are resident too; the graph the simulator reads for such a step creates none
    (:func:`chkpt_opt.memory_model.sequence.gradients.holding_parameter_gradients`).

    Optimizer state is ``state_copies`` times the trainable parameter bytes, plus one step
    counter per trainable tensor. The temporaries of one optimizer step are
    ``foreach_extra_copies`` copies of all trainable parameters when the optimizer runs
    ``foreach`` (PyTorch's default on CUDA), else ``single_extra_copies`` copies of the
    largest parameter.

    Example:
        >>> s = static_memory(param_bytes=100, trainable_param_bytes=100, buffer_bytes=0,
        ...                   input_bytes=10, optimizer=optimizer_spec("adamw"))
        >>> s.optimizer_state_bytes, s.resident_bytes
        (200, 310)
    """
    state = 0
    extra = 0
    if optimizer is not None:
        state = optimizer.state_copies * trainable_param_bytes
        state += optimizer.step_tensor_bytes * n_trainable_tensors
        if foreach:
            extra = optimizer.foreach_extra_copies * trainable_param_bytes
        else:
            extra = optimizer.single_extra_copies * (largest_param_bytes or trainable_param_bytes)
    return StaticMemory(
        param_bytes=param_bytes,
        buffer_bytes=buffer_bytes,
        input_bytes=input_bytes,
        optimizer_state_bytes=state,
        grad_bytes=trainable_param_bytes,
        optimizer_step_extra_bytes=extra,
        resident_grad_bytes=trainable_param_bytes if grads_held else 0,
    )


def graph_static_memory(
    graph_attrs: dict[str, object], optimizer: OptimizerSpec | None, *, foreach: bool | None = None
) -> StaticMemory:
    """:func:`static_memory` from a cost graph's attributes (``graph.graph``).

    ``foreach`` defaults to True for graphs traced for CUDA (or on the meta device), where
    PyTorch's optimizers use their ``foreach`` implementations. A graph that says
    :data:`~chkpt_opt.memory_model.sequence.gradients.PARAM_GRADS_HELD` counts the
    gradients resident.
    """
    device = str(graph_attrs.get("device_type", "cpu"))
    return static_memory(
        param_bytes=int(graph_attrs["param_bytes"]),  # type: ignore[call-overload]
        trainable_param_bytes=int(graph_attrs["trainable_param_bytes"]),  # type: ignore[call-overload]
        buffer_bytes=int(graph_attrs["buffer_bytes"]),  # type: ignore[call-overload]
        input_bytes=int(graph_attrs["input_bytes"]),  # type: ignore[call-overload]
        n_trainable_tensors=int(graph_attrs.get("n_trainable_tensors", 0)),  # type: ignore[call-overload]
        largest_param_bytes=int(graph_attrs.get("largest_param_bytes", 0)) or None,  # type: ignore[call-overload]
        optimizer=optimizer,
        foreach=device in ("cuda", "meta") if foreach is None else foreach,
        grads_held=bool(graph_attrs.get(PARAM_GRADS_HELD, False)),
    )
