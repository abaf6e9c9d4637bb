"""The budget contract: parsing, formatting, the split of a step budget, optimizer state."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from chkpt_opt.api import activation_budget, static_memory_for, trace
from chkpt_opt.errors import BudgetError, ChkptOptError
from chkpt_opt.graphs.costgraph import new_graph
from chkpt_opt.step_budget.budget import (
    OPTIMIZERS,
    Budget,
    StaticMemory,
    format_bytes,
    format_bytes_pair,
    graph_static_memory,
    optimizer_spec,
    parse_budget,
    split_budget,
    static_memory,
)
from chkpt_opt.step_budget.whole_step import unmet_budget_error

# Fragments every "accepted forms" message must show.
ACCEPTED_FRAGMENTS = ('"20GB"', '"20GiB"', "KiB", "MiB", "TiB", "int of bytes")


def assert_shows_accepted_forms(message: str) -> None:
    for fragment in ACCEPTED_FRAGMENTS:
        assert fragment in message, f"{fragment!r} missing from: {message}"


# ---- parse_budget: accepted forms -----------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("20GB", 20 * 10**9),
        ("20GiB", 20 * 2**30),
        ("3kB", 3 * 10**3),
        ("3KB", 3 * 10**3),
        ("3KiB", 3 * 2**10),
        ("7MB", 7 * 10**6),
        ("7MiB", 7 * 2**20),
        ("2TB", 2 * 10**12),
        ("2TiB", 2 * 2**40),
        ("100B", 100),
        ("1.5GiB", 1_610_612_736),
        ("1.5GB", 1_500_000_000),
        ("0.5MiB", 2**19),
        (".25GiB", 2**28),
        ("20 GB", 20 * 10**9),
        ("  20GiB  ", 20 * 2**30),
        ("512 MiB", 512 * 2**20),
    ],
)
def test_parse_budget_string_units_give_exact_bytes(text: str, expected: int) -> None:
    budget = parse_budget(text)
    assert budget.total_bytes == expected
    assert isinstance(budget.total_bytes, int)
    assert budget.text == text


def test_parse_budget_decimal_and_binary_units_differ() -> None:
    assert parse_budget("20GiB").total_bytes - parse_budget("20GB").total_bytes == (
        20 * 2**30 - 20 * 10**9
    )


@pytest.mark.parametrize("value", [1, 4096, 2_000_000_000, 3 * 2**40])
def test_parse_budget_plain_int_is_bytes(value: int) -> None:
    assert parse_budget(value).total_bytes == value


def test_parse_budget_passes_budget_objects_through() -> None:
    budget = Budget(total_bytes=123, text="123")
    assert parse_budget(budget) is budget


@pytest.mark.parametrize(("text", "expected"), [("2.01kB", 2010), ("1.005GB", 1_005_000_000)])
def test_parse_budget_decimals_are_exact(text: str, expected: int) -> None:
    assert parse_budget(text).total_bytes == expected


# ---- parse_budget: refused forms --------------------------------------------------------


@pytest.mark.parametrize("text", ["20gb", "20Gb", "20kb", "20mb", "20Tb"])
def test_parse_budget_refuses_bits_and_shows_accepted_forms(text: str) -> None:
    with pytest.raises(BudgetError) as info:
        parse_budget(text)
    message = str(info.value)
    assert repr(text) in message
    assert "bits" in message
    assert_shows_accepted_forms(message)


@pytest.mark.parametrize(("text", "suggested"), [("20gb", "GB"), ("20Gb", "GB"), ("5mb", "MB")])
def test_parse_budget_bits_hint_suggests_byte_unit(text: str, suggested: str) -> None:
    with pytest.raises(BudgetError, match=f"for bytes write {suggested}"):
        parse_budget(text)


@pytest.mark.parametrize("text", ["20gib", "20kib", "20mib"])
def test_parse_budget_bits_hint_names_an_accepted_unit(text: str) -> None:
    with pytest.raises(BudgetError) as info:
        parse_budget(text)
    hint = str(info.value).split("for bytes write ")[1].split(".")[0]
    assert parse_budget(f"20{hint}").total_bytes > 0


def test_parse_budget_refuses_unitless_string_and_suggests_units() -> None:
    with pytest.raises(BudgetError) as info:
        parse_budget("20")
    message = str(info.value)
    assert "no unit" in message
    assert '"20GB"' in message and '"20GiB"' in message
    assert_shows_accepted_forms(message)


@pytest.mark.parametrize("text", ["20XB", "20GIB", "20 G B", "1,000GB", "GB", "", "1e3GB"])
def test_parse_budget_refuses_unknown_units_and_shows_accepted_forms(text: str) -> None:
    with pytest.raises(BudgetError) as info:
        parse_budget(text)
    assert repr(text) in str(info.value)
    assert_shows_accepted_forms(str(info.value))


@pytest.mark.parametrize("value", [1.5, 2e9, True, False, None, [20], b"20GB"])
def test_parse_budget_refuses_non_int_non_str_and_shows_accepted_forms(value: object) -> None:
    with pytest.raises(BudgetError) as info:
        parse_budget(value)  # type: ignore[arg-type]
    message = str(info.value)
    assert type(value).__name__ in message
    assert_shows_accepted_forms(message)


@pytest.mark.parametrize("value", [0, -1, -(2**40)])
def test_parse_budget_refuses_nonpositive_ints(value: int) -> None:
    with pytest.raises(BudgetError, match="positive") as info:
        parse_budget(value)
    assert str(value) in str(info.value)


@pytest.mark.parametrize("text", ["0GB", "0.0MiB", "0.0000000001GB"])
def test_parse_budget_refuses_strings_below_one_byte(text: str) -> None:
    with pytest.raises(BudgetError, match="at least one byte"):
        parse_budget(text)


def test_parse_budget_refuses_negative_string_and_shows_accepted_forms() -> None:
    with pytest.raises(BudgetError) as info:
        parse_budget("-5GB")
    assert_shows_accepted_forms(str(info.value))


def test_budget_error_is_a_value_error_and_a_chkpt_opt_error() -> None:
    with pytest.raises(ValueError):
        parse_budget("20gb")
    with pytest.raises(ChkptOptError):
        parse_budget("20gb")


# ---- percentages --------------------------------------------------------------------------


def test_percent_budget_without_cuda_device_is_refused_mentioning_cuda() -> None:
    with pytest.raises(BudgetError) as info:
        parse_budget("80%")
    message = str(info.value)
    assert "CUDA" in message
    assert '"20GB"' in message  # says what to give instead


@pytest.mark.parametrize(
    ("text", "total", "expected"),
    [
        ("80%", 80 * 10**9, 64 * 10**9),
        ("12.5%", 80 * 2**30, 10 * 2**30),
        ("100%", 1000, 1000),
        ("50 %", 4096, 2048),
    ],
)
def test_percent_budget_is_the_fraction_of_the_device(text: str, total: int, expected: int) -> None:
    budget = parse_budget(text, device_total_bytes=total)
    assert budget.total_bytes == expected
    assert budget.text == text


@pytest.mark.parametrize("text", ["0%", "150%", "100.5%"])
def test_percent_budget_outside_0_100_is_refused(text: str) -> None:
    with pytest.raises(BudgetError, match=r"\(0%, 100%\]"):
        parse_budget(text, device_total_bytes=10**9)


def test_activation_budget_percent_on_cpu_graph_is_refused_mentioning_cuda() -> None:
    graph = new_graph("g", param_bytes=100, trainable_param_bytes=100)
    with pytest.raises(BudgetError, match="CUDA"):
        activation_budget(graph, "80%", optimizer=None)


# ---- format_bytes -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_bytes", "expected"),
    [
        (2 * 2**30, "2.15 GB (2.00 GiB)"),
        (20 * 10**9, "20.00 GB (18.63 GiB)"),
        (10**8, "0.10 GB (0.09 GiB)"),
    ],
)
def test_format_bytes_shows_gb_and_gib(num_bytes: int, expected: str) -> None:
    assert format_bytes(num_bytes) == expected


_FORMATTED = re.compile(r"^(?P<dec>\S+) (?P<unit>[kMG])B \((?P<bin>\S+) (?P<binunit>[KMG])iB\)$")
_SCALE = {"k": (10**3, 2**10), "M": (10**6, 2**20), "G": (10**9, 2**30)}


@pytest.mark.parametrize(
    ("num_bytes", "unit"),
    [
        (353_000, "M"),
        (35_000, "k"),
        (5 * 2**20, "M"),
        (12_345_678, "M"),
        (99_999_999, "M"),
        (7 * 10**12, "G"),
    ],
)
def test_format_bytes_values_are_accurate_in_both_units(num_bytes: int, unit: str) -> None:
    """A readable unit for the size (no "3.28e-05 GB"), the same scale in both systems."""
    match = _FORMATTED.match(format_bytes(num_bytes))
    assert match, format_bytes(num_bytes)
    assert match["unit"] == unit and match["binunit"] == unit.upper()
    decimal, binary = _SCALE[unit]
    assert float(match["dec"]) == pytest.approx(num_bytes / decimal, rel=0.01)
    assert float(match["bin"]) == pytest.approx(num_bytes / binary, rel=0.01)
    assert "e-" not in format_bytes(num_bytes)


def test_format_bytes_small_counts_are_bytes() -> None:
    assert format_bytes(0) == "0 bytes"
    assert format_bytes(64) == "64 bytes"


def test_budget_str_shows_both_units() -> None:
    assert str(parse_budget("20GiB")) == "21.47 GB (20.00 GiB)"


# ---- optimizer specs and static memory --------------------------------------------------


def test_optimizer_spec_adamw_keeps_two_states_and_a_step_counter() -> None:
    spec = optimizer_spec("adamw")
    assert spec is not None
    assert (spec.state_copies, spec.step_tensor_bytes) == (2, 4)


def test_optimizer_spec_is_case_insensitive() -> None:
    assert optimizer_spec("AdamW") == optimizer_spec("adamw")


def test_optimizer_spec_none_means_no_state() -> None:
    assert optimizer_spec(None) is None


def test_optimizer_spec_unknown_name_lists_known_names() -> None:
    with pytest.raises(BudgetError) as info:
        optimizer_spec("lion")
    message = str(info.value)
    assert "'lion'" in message
    for name in OPTIMIZERS:
        assert name in message


def _adamw_static(*, trainable: int, largest: int, foreach: bool) -> StaticMemory:
    return static_memory(
        param_bytes=trainable + 200,
        trainable_param_bytes=trainable,
        buffer_bytes=64,
        input_bytes=256,
        n_trainable_tensors=6,
        largest_param_bytes=largest,
        optimizer=optimizer_spec("adamw"),
        foreach=foreach,
    )


def test_static_memory_adamw_state_is_two_copies_plus_four_bytes_per_tensor() -> None:
    s = _adamw_static(trainable=800, largest=400, foreach=False)
    assert s.optimizer_state_bytes == 2 * 800 + 4 * 6
    assert s.grad_bytes == 800
    assert s.param_bytes == 1000
    assert s.resident_bytes == 1000 + 64 + 256 + 2 * 800 + 4 * 6
    # the optimizer phase is the gradients plus the step's temporaries
    assert s.optimizer_step_extra_bytes > 0
    assert s.optimizer_phase_bytes == 800 + s.optimizer_step_extra_bytes


def test_static_memory_per_tensor_step_temporaries_scale_with_largest_param() -> None:
    base = _adamw_static(trainable=800, largest=400, foreach=False)
    more_params = _adamw_static(trainable=1600, largest=400, foreach=False)
    larger = _adamw_static(trainable=800, largest=800, foreach=False)
    assert more_params.optimizer_step_extra_bytes == base.optimizer_step_extra_bytes
    assert larger.optimizer_step_extra_bytes == 2 * base.optimizer_step_extra_bytes
    assert base.optimizer_step_extra_bytes % 400 == 0


def test_static_memory_foreach_step_temporaries_scale_with_all_trainable_params() -> None:
    base = _adamw_static(trainable=800, largest=400, foreach=True)
    more_params = _adamw_static(trainable=1600, largest=400, foreach=True)
    larger = _adamw_static(trainable=800, largest=800, foreach=True)
    assert base.optimizer_step_extra_bytes > 0
    assert more_params.optimizer_step_extra_bytes == 2 * base.optimizer_step_extra_bytes
    assert larger.optimizer_step_extra_bytes == base.optimizer_step_extra_bytes
    assert base.optimizer_step_extra_bytes % 800 == 0


def test_static_memory_sgd_has_no_state() -> None:
    s = static_memory(
        param_bytes=1000,
        trainable_param_bytes=1000,
        buffer_bytes=10,
        input_bytes=20,
        n_trainable_tensors=4,
        optimizer=optimizer_spec("sgd"),
    )
    assert s.optimizer_state_bytes == 0
    assert s.optimizer_phase_bytes == 0
    assert s.resident_bytes == 1030


def test_static_memory_without_optimizer_has_no_state_or_phase() -> None:
    s = static_memory(
        param_bytes=50, trainable_param_bytes=50, buffer_bytes=0, input_bytes=5, optimizer=None
    )
    assert (s.optimizer_state_bytes, s.optimizer_phase_bytes, s.resident_bytes) == (0, 0, 55)


def test_graph_static_memory_defaults_foreach_on_cuda_and_meta_only() -> None:
    attrs = dict(
        new_graph(
            "g",
            param_bytes=1000,
            trainable_param_bytes=1000,
            largest_param_bytes=300,
            n_trainable_tensors=4,
        ).graph
    )
    adamw = optimizer_spec("adamw")

    def expected(foreach: bool) -> int:
        return static_memory(
            param_bytes=1000,
            trainable_param_bytes=1000,
            buffer_bytes=0,
            input_bytes=0,
            n_trainable_tensors=4,
            largest_param_bytes=300,
            optimizer=adamw,
            foreach=foreach,
        ).optimizer_step_extra_bytes

    assert expected(True) != expected(False)  # the two settings are distinguishable
    assert graph_static_memory(attrs, adamw).optimizer_step_extra_bytes == expected(False)
    for device in ("cuda", "meta"):
        attrs["device_type"] = device
        assert graph_static_memory(attrs, adamw).optimizer_step_extra_bytes == expected(True)
        assert graph_static_memory(attrs, adamw, foreach=False).optimizer_step_extra_bytes == (
            expected(False)
        )
    assert graph_static_memory(attrs, adamw).optimizer_state_bytes == 2 * 1000 + 4 * 4


# ---- split_budget -----------------------------------------------------------------------


def _static(**overrides: int) -> StaticMemory:
    values = dict(
        param_bytes=4 * 10**9,
        buffer_bytes=10**6,
        input_bytes=2 * 10**6,
        optimizer_state_bytes=8 * 10**9,
        grad_bytes=4 * 10**9,
        optimizer_step_extra_bytes=10**9,
    )
    values.update(overrides)
    return StaticMemory(**values)


def test_split_budget_subtracts_params_buffers_inputs_and_optimizer_state() -> None:
    static = _static()
    dynamic = split_budget(parse_budget("20GB"), static)
    assert dynamic == 20 * 10**9 - (4 * 10**9 + 10**6 + 2 * 10**6 + 8 * 10**9)
    # gradients are not subtracted: the simulator places them in time
    assert dynamic == 20 * 10**9 - static.resident_bytes


def test_split_budget_when_resident_exceeds_budget_reports_both_units() -> None:
    with pytest.raises(BudgetError) as info:
        split_budget(parse_budget("10GB"), _static())
    message = str(info.value)
    assert "'10GB'" in message
    assert "10.00 GB (9.31 GiB)" in message  # the budget
    assert format_bytes(_static().resident_bytes) in message  # what lives through the step
    assert "GiB" in message and "GB" in message


def test_split_budget_refuses_budget_equal_to_resident() -> None:
    static = _static()
    with pytest.raises(BudgetError):
        split_budget(parse_budget(static.resident_bytes), static)


def test_split_budget_refuses_when_optimizer_phase_does_not_fit() -> None:
    static = _static()
    # resident fits, but not resident + grads + optimizer temporaries
    budget = parse_budget(static.resident_bytes + static.optimizer_phase_bytes - 1)
    with pytest.raises(BudgetError) as info:
        split_budget(budget, static)
    message = str(info.value)
    assert "optimizer" in message
    assert format_bytes(static.optimizer_phase_bytes) in message
    assert "GiB" in message


def test_split_budget_accepts_optimizer_phase_exactly_at_the_limit() -> None:
    static = _static()
    budget = parse_budget(static.resident_bytes + static.optimizer_phase_bytes)
    assert split_budget(budget, static) == static.optimizer_phase_bytes


def test_split_budget_without_optimizer_ignores_gradients_for_the_phase_check() -> None:
    static = _static(optimizer_state_bytes=0, optimizer_step_extra_bytes=0)
    assert split_budget(parse_budget(static.resident_bytes + 1), static) == 1


# ---- static_memory_for with torch.optim instances ------------------------------------------


@pytest.fixture(scope="module")
def small_model_graph() -> tuple[nn.Module, torch.Tensor, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)).train()
    model[0].bias.requires_grad_(False)  # a frozen parameter: no state for it
    x = torch.randn(5, 8)
    return model, x, trace(model, (x,))


def _real_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    seen: set[int] = set()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and id(value.untyped_storage()) not in seen:
                seen.add(id(value.untyped_storage()))
                total += value.untyped_storage().nbytes()
    return total


@pytest.mark.parametrize(
    ("make", "state_copies"),
    [
        (lambda ps: torch.optim.AdamW(ps, lr=1e-3), 2),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1),
        (lambda ps: torch.optim.SGD(ps, lr=0.1), 0),
        (lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True), 3),
        (lambda ps: torch.optim.Adam(ps, lr=1e-3), 2),
    ],
    ids=["adamw", "sgd_momentum", "sgd", "adam_amsgrad", "adam"],
)
def test_static_memory_for_optimizer_instances_matches_real_state(
    small_model_graph: tuple[nn.Module, torch.Tensor, object], make: object, state_copies: int
) -> None:
    model, x, graph = small_model_graph
    trainable = [p for p in model.parameters() if p.requires_grad]
    trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
    optimizer = make(trainable)  # type: ignore[operator]
    static = static_memory_for(graph, optimizer)  # type: ignore[arg-type]
    step_bytes = 4 * len(trainable) if state_copies >= 2 else 0
    assert static.optimizer_state_bytes == state_copies * trainable_bytes + step_bytes
    # and it is what torch really allocates after one step
    model.zero_grad()
    model(x).sum().backward()
    optimizer.step()
    assert static.optimizer_state_bytes == _real_state_bytes(optimizer)


def test_static_memory_for_name_matches_instance(
    small_model_graph: tuple[nn.Module, torch.Tensor, object],
) -> None:
    model, _, graph = small_model_graph
    by_name = static_memory_for(graph, "adamw")  # type: ignore[arg-type]
    by_instance = static_memory_for(graph, torch.optim.AdamW(model.parameters()))  # type: ignore[arg-type]
    assert by_name.optimizer_state_bytes == by_instance.optimizer_state_bytes
    assert by_name.param_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert by_name.buffer_bytes == sum(b.numel() * b.element_size() for b in model.buffers())
    assert by_name.input_bytes == 5 * 8 * 4


def test_static_memory_for_unsupported_optimizer_class_is_refused(
    small_model_graph: tuple[nn.Module, torch.Tensor, object],
) -> None:
    model, _, graph = small_model_graph
    with pytest.raises(BudgetError) as info:
        static_memory_for(graph, torch.optim.LBFGS(model.parameters()))  # type: ignore[arg-type]
    message = str(info.value)
    assert "LBFGS" in message
    assert "'adamw'" in message and "optimizer=None" in message


def test_static_memory_for_non_optimizer_object_is_refused(
    small_model_graph: tuple[nn.Module, torch.Tensor, object],
) -> None:
    _, _, graph = small_model_graph
    with pytest.raises(BudgetError, match=r"torch\.optim\.Optimizer"):
        static_memory_for(graph, 42)  # type: ignore[arg-type]


# ---- two figures side by side: never read the same ------------------------------------


@pytest.mark.parametrize(
    ("first", "second"),
    [(104_000_000, 110_000_000), (104_000_000, 104_000_001), (35_000, 35_001), (12, 13)],
)
def test_a_pair_of_figures_reads_differently_in_both_units(first: int, second: int) -> None:
    a, b = format_bytes_pair(first, second)
    (dec_a, _, bin_a), (dec_b, _, bin_b) = a.partition(" ("), b.partition(" (")
    assert dec_a != dec_b and (bin_a != bin_b or not bin_a)
    assert format_bytes_pair(first, first) == (format_bytes(first), format_bytes(first))


def test_the_pair_keeps_format_bytes_digits_where_those_differ() -> None:
    # 0.104 and 0.11 GB: both 0.10 GiB at two decimals, so one more digit for both
    assert format_bytes(104_000_000) == "0.10 GB (0.10 GiB)"
    assert format_bytes_pair(104_000_000, 110_000_000) == (
        "0.104 GB (0.097 GiB)",
        "0.110 GB (0.102 GiB)",
    )
    assert format_bytes_pair(20 * 10**9, 30 * 10**9) == (
        format_bytes(20 * 10**9),
        format_bytes(30 * 10**9),
    )


def test_an_unmet_budget_and_the_smallest_one_are_printed_apart(
    small_model_graph: tuple[nn.Module, torch.Tensor, object],
) -> None:
    _, _, graph = small_model_graph
    _, static, _ = activation_budget(graph, 10**12, optimizer=None)  # type: ignore[arg-type]
    minimum = unmet_budget_error(graph, parse_budget(1), static, 0).min_feasible_bytes  # type: ignore[arg-type]
    assert minimum is not None
    budget = parse_budget(minimum - 1)  # one byte short
    error = unmet_budget_error(graph, budget, static, minimum - 1 - static.resident_bytes)  # type: ignore[arg-type]
    match = re.search(r"= (.+?) is below .+?: (.+?) \(\d+ bytes", str(error))
    assert match is not None, str(error)
    given, needed = match.groups()
    assert (given, needed) == format_bytes_pair(minimum - 1, minimum)
    assert given.partition(" (")[0] != needed.partition(" (")[0]
    assert given.partition(" (")[2] != needed.partition(" (")[2]
