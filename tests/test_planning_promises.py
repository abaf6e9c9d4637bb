"""Planning keeps its promise: ``time_limit_s`` bounds the whole planning of a training
step (capture, op timing, solve, timed choice), and nothing chkpt_opt starts (watchdog
threads, the HiGHS child process) outlives it."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import chkpt_opt
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers import SolveStatus
from tests.attachment.tiny_models import tiny_llama

transformers = pytest.importorskip("transformers")

VOCAB = 512
LIMIT_S = 10.0
STEP_LIMIT_S = 20.0
"""The first training step captures twice (fixed and symbolic sizes, 4-13 s together for
this model on 2 loaded cores), which no limit cuts short."""
SLACK_S = 5.0
STAGES = {"capture", "op timing", "solve", "timed choice"}


def child_pids() -> list[int]:
    """The process ids of this process's children, reaped or not (Linux)."""
    tasks = Path(f"/proc/{os.getpid()}/task")
    return [int(pid) for task in tasks.iterdir() for pid in (task / "children").read_text().split()]


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (4, 64), generator=gen)
    return {"input_ids": ids, "labels": torch.randint(0, VOCAB, (4, 64), generator=gen)}


@pytest.fixture(scope="module")
def budget_bytes() -> int:
    """The whole step (AdamW) at 60% of a 4-layer Llama's keep-all activations: no
    schedule is proven optimal within the limit there (the full solve takes longer)."""
    base = chkpt_opt.plan(
        tiny_llama(vocab=VOCAB, layers=4, max_positions=128),
        (),
        example_kwargs=_batch(),
        budget=10**12,
        solver="keep_all",
        profile_times=False,
    )
    return base.static.step_peak_bytes(int(0.6 * simulate(base.graph, Schedule()).peak_bytes))


def _new_threads(before: set[threading.Thread]) -> list[str]:
    """Threads alive now that were not before, but tqdm's monitor (a daemon that tqdm starts
    with its first progress bar, one of which torch.export's capture shows, and keeps)."""
    return [
        t.name
        for t in threading.enumerate()
        if t not in before and t.is_alive() and t.name != "tqdm_monitor"
    ]


def test_plan_returns_within_its_limit_and_leaves_nothing_running(budget_bytes: int) -> None:
    model = tiny_llama(vocab=VOCAB, layers=4, max_positions=128)
    before = set(threading.enumerate())
    start = time.perf_counter()
    made = chkpt_opt.plan(
        model, (), example_kwargs=_batch(), budget=budget_bytes, time_limit_s=LIMIT_S
    )
    elapsed = time.perf_counter() - start
    assert made.result.status != SolveStatus.OPTIMAL  # the full solve would take longer
    assert elapsed <= LIMIT_S + SLACK_S, (elapsed, made.result.stats["planning_s"])
    assert not _new_threads(before) and not child_pids()
    planning: dict[str, Any] = made.result.stats["planning_s"]
    assert set(planning) == STAGES
    assert sum(planning.values()) <= elapsed + 0.1


def test_the_first_training_step_plans_within_the_limit_and_leaves_nothing_running(
    budget_bytes: int, caplog: pytest.LogCaptureFixture
) -> None:
    model = chkpt_opt.optimize(
        tiny_llama(vocab=VOCAB, layers=4, max_positions=128),
        budget=budget_bytes,
        time_limit_s=STEP_LIMIT_S,
    )
    attachment = chkpt_opt.attachment_of(model)
    optimizer = torch.optim.AdamW(model.parameters())
    before = set(threading.enumerate())
    with caplog.at_level("INFO", logger="chkpt_opt"):
        model(**_batch()).loss.backward()
        optimizer.step()
    assert attachment.stats.solves == 1
    assert attachment.stats.prepare_s <= STEP_LIMIT_S + SLACK_S, attachment.stats
    assert set(attachment.stats.planning_s) == STAGES
    assert sum(attachment.stats.planning_s.values()) <= attachment.stats.prepare_s
    assert not _new_threads(before) and not child_pids()
    for name in STAGES:  # progress at INFO: each stage started and finished
        assert f"planning: {name} started" in caplog.text
        assert f"planning: {name} finished in" in caplog.text
