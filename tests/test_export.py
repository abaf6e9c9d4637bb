"""Plan files: save, load in a fresh process, apply without solving; refusals; the schema."""

from __future__ import annotations

import functools
import hashlib
import json
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch

import chkpt_opt
from chkpt_opt import zoo
from chkpt_opt.api import smallest_peak
from chkpt_opt.measurement.step import measure_step
from tests.conftest import budget_at

GPT = {"n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 32, "batch": 4, "vocab": 128}


def _small_budget(model, args) -> int:
    full = chkpt_opt.plan(model, args, budget=10**15, optimizer=None, profile_times=False)
    return full.static.resident_bytes + smallest_peak(full.graph, time_limit_s=10).peak_bytes


@functools.cache
def _gpt_small_budget() -> int:
    """:func:`_small_budget` of the GPT every test here builds (seeded: the same model),
    searched once per process."""
    model, args, _ = zoo.gpt(**GPT)
    return _small_budget(model, args)


def _grad_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(name.encode())
        digest.update(p.grad.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


FRESH_PROCESS = """
import hashlib, json, sys, torch
import chkpt_opt
from chkpt_opt import zoo
from chkpt_opt.measurement.step import measure_step
torch.set_num_threads(int(sys.argv[3]))  # the parent's: the same sums in the same order
model, args, kwargs = zoo.gpt(**json.loads(sys.argv[2]))
optimized = chkpt_opt.apply(model, sys.argv[1], args)
torch.manual_seed(0)
peak = measure_step(optimized, args).peak_bytes
digest = hashlib.sha256()
for name, p in model.named_parameters():
    digest.update(name.encode())
    digest.update(p.grad.detach().contiguous().numpy().tobytes())
print(json.dumps({"peak": peak, "grads": digest.hexdigest()}))
"""


def test_round_trip_through_a_fresh_process(tmp_path: Path) -> None:
    model, args, _ = zoo.gpt(**GPT)
    plan = chkpt_opt.plan(
        model,
        args,
        budget=_gpt_small_budget(),
        optimizer=None,
        time_limit_s=10,
        profile_times=False,
    )
    assert plan.schedule.regions or plan.schedule.staged  # it recomputes (dropout included)
    path = tmp_path / "plan.json"
    plan.save(path)
    torch.manual_seed(0)
    here = measure_step(plan.apply(), args).peak_bytes
    digest = _grad_digest(model)
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            FRESH_PROCESS,
            str(path),
            json.dumps(GPT),
            str(torch.get_num_threads()),
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parent.parent,
    )
    there = json.loads(result.stdout.strip().splitlines()[-1])
    assert there["peak"] == here
    assert there["grads"] == digest


def test_file_validates_against_the_published_schema(tmp_path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(
        resources.files("chkpt_opt").joinpath("schemas/schedule-v1.schema.json").read_text()
    )
    model, args, _ = zoo.gpt(**GPT)
    static = chkpt_opt.plan(
        model, args, budget=10**15, optimizer="adamw", profile_times=False
    ).static
    budget = _gpt_small_budget() + static.optimizer_state_bytes + static.optimizer_phase_bytes
    plan = chkpt_opt.plan(
        model, args, budget=budget, optimizer="adamw", time_limit_s=3, profile_times=False
    )  # any plan that fits: the file's form is checked
    path = tmp_path / "plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    jsonschema.validate(data, schema)
    assert data["torch_version"] == str(torch.__version__)
    assert data["predicted_peak_bytes"] == plan.predicted_peak_bytes
    broken = dict(data, format_version=2)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_file_for_other_shapes_or_another_model_is_refused(tmp_path: Path) -> None:
    model, args, _ = zoo.gpt(**GPT)
    plan = chkpt_opt.plan(
        model,
        args,
        budget=_gpt_small_budget(),
        optimizer=None,
        time_limit_s=3,  # any plan that fits: the file's fingerprint is checked
        profile_times=False,
    )
    path = tmp_path / "plan.json"
    plan.save(path)
    other_shape = zoo.gpt(**dict(GPT, batch=8))
    with pytest.raises(chkpt_opt.ScheduleError, match="fingerprint") as info:
        chkpt_opt.apply(other_shape[0], path, other_shape[1])
    assert "other input shapes" in str(info.value)
    other_model = zoo.gpt(**dict(GPT, n_layer=3))
    with pytest.raises(chkpt_opt.ScheduleError, match="fingerprint"):
        chkpt_opt.apply(other_model[0], path, other_model[1])


def test_malformed_plan_files_are_refused(tmp_path: Path) -> None:
    model, args, _ = zoo.gpt(**GPT)
    path = tmp_path / "plan.json"
    path.write_text('{"format": "chkpt_opt.memory_model.schedule", "format_version": 9}')
    with pytest.raises(chkpt_opt.ScheduleError, match="format_version 9"):
        chkpt_opt.apply(model, path, args)
    path.write_text('{"format": "chkpt_opt.memory_model.schedule", "format_ver')
    with pytest.raises(chkpt_opt.ScheduleError, match="not valid JSON"):
        chkpt_opt.apply(model, path, args)
    with pytest.raises(chkpt_opt.ScheduleError, match="does not exist"):
        chkpt_opt.apply(model, tmp_path / "missing.json", args)


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param({"n_layer": 2, "d_model": 64, "seq_len": 64, "batch": 4, "vocab": 256}),
        pytest.param({}, marks=pytest.mark.slow, id="reference"),  # 8 layers, d 256, seq 256
    ],
    ids=lambda settings: "small" if settings else "reference",
)
def test_exported_plan_meets_the_eager_budget_under_torch_compile(
    settings: dict, tmp_path: Path
) -> None:
    """A plan file applied for torch.compile meets the budget that the eager plan meets,
    measured on the same ruler (the allocator's events) for both."""
    import torch._dynamo

    from chkpt_opt.measurement.step import measure_step_allocator, run_step

    model, args, _ = zoo.gpt(**settings)
    budget = budget_at(model, args, 0.5)
    plan = chkpt_opt.plan(
        model, args, budget=budget, optimizer=None, solver="greedy", profile_times=False
    )
    assert plan.schedule.regions
    path = tmp_path / "gpt.plan.json"
    plan.save(path)
    eager = chkpt_opt.apply(model, path, args)
    torch.manual_seed(0)
    assert plan.static.resident_bytes + measure_step_allocator(eager, args) <= budget
    torch._dynamo.reset()
    compiled = chkpt_opt.compile_module(chkpt_opt.apply(model, path, args, for_compile=True))
    for _ in range(2):  # compile forward and backward
        run_step(compiled, args, {})
    torch.manual_seed(0)
    peak = measure_step_allocator(compiled, args)
    assert plan.static.resident_bytes + peak <= budget, (peak, budget)
    torch._dynamo.reset()
