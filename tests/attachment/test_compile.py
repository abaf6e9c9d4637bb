"""``torch.compile`` around an attached plan, in the orders people write it:
``torch.compile(chkpt_opt.optimize(model, budget=B))`` (nanoGPT's train.py, torchtitan) and
``chkpt_opt.optimize(model, budget=B)`` then ``model.compile()``.

Each model runs in a subprocess (a crash inside compiled code, as the segmentation fault
this file was written against, would take pytest down): a nanoGPT-style GPT
(:func:`chkpt_opt.zoo.gpt`) and a Hugging Face ``LlamaForCausalLM`` from a tiny config.
There, each order trains three AdamW steps beside the compiled original, from the same
weights, and one more step is measured with the allocator's events
(:func:`~chkpt_opt.measurement.step.measure_step_allocator`, the ruler
``tests/test_compiled.py`` measures compiled plans with). The budget is the peak of the
same step compiled with per-block ``torch.utils.checkpoint`` (non-reentrant), on top of the
resident bytes the project counts for the step (parameters, AdamW state, inputs).

Run one alone: ``python -m tests.attachment.test_compile gpt``.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import chkpt_opt
from chkpt_opt.attachment.compiled_call import MEASURED_PLANS, CompiledCalls, compiled_calls
from chkpt_opt.errors import ChkptOptError, InfeasibleBudgetError

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
ORDERS = ("torch.compile(optimize(model))", "optimize(model); model.compile()")


# -- what runs in the subprocess --------------------------------------------------------------


class _Checkpointed(torch.nn.Module):
    """A block under non-reentrant ``torch.utils.checkpoint`` (the per-block baseline)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def _gpt() -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any], torch.nn.Module]:
    """The GPT (no dropout: compiled and eager kernels draw other random numbers), its
    inputs, and a copy with every block checkpointed."""
    from chkpt_opt import zoo

    model, args, kwargs = zoo.gpt(n_layer=3, d_model=64, seq_len=64, batch=4, vocab=128, dropout=0)
    per_block = copy.deepcopy(model)
    per_block.blocks = torch.nn.ModuleList(_Checkpointed(b) for b in per_block.blocks)
    return model, args, kwargs, per_block


def _llama() -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any], torch.nn.Module]:
    """The Llama, a batch with labels, and a copy under Hugging Face's own per-layer
    checkpointing (non-reentrant)."""
    from tests.attachment.tiny_models import tiny_llama

    model = tiny_llama(vocab=256, layers=3)
    gen = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(0, 256, (2, 64), generator=gen),
        "labels": torch.randint(0, 256, (2, 64), generator=gen),
        "use_cache": False,
    }
    per_block = copy.deepcopy(model)
    per_block.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, (), batch, per_block


MODELS = {"gpt": _gpt, "llama": _llama}


def _loss(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


def _train(
    module: Any, params: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """``STEPS`` AdamW steps of ``module`` (whose parameters are ``params``'): the losses and
    the gradients of each step."""
    optimizer = torch.optim.AdamW(params.parameters(), lr=1e-3)
    losses, grads = [], []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = _loss(module(*args, **kwargs))
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in params.named_parameters()})
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return losses, grads


def _peak(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    from chkpt_opt.measurement.step import measure_step_allocator

    return measure_step_allocator(module, args, kwargs)


def _largest_difference(
    grads: list[dict[str, torch.Tensor]], expected: list[dict[str, torch.Tensor]]
) -> float:
    """The largest difference of any gradient entry, relative to the largest entry of its
    tensor in ``expected``, over every step."""
    return max(
        float((g[n] - e[n]).abs().max() / e[n].abs().max().clamp_min(1e-12))
        for g, e in zip(grads, expected, strict=True)
        for n in e
    )


def run(name: str) -> dict[str, Any]:
    """Trains ``name``'s model compiled with the plan attached, in both orders, beside the
    compiled original; returns what the test checks (JSON-ready)."""
    from chkpt_opt.step_budget.whole_step import static_memory_for

    torch._dynamo.reset()
    model, args, kwargs, per_block = MODELS[name]()
    initial = copy.deepcopy(model.state_dict())
    reference = copy.deepcopy(model)
    compiled_reference = torch.compile(reference)
    ref_losses, ref_grads = _train(compiled_reference, reference, args, kwargs)
    eager = copy.deepcopy(model)
    eager_losses, eager_grads = _train(eager, eager, args, kwargs)
    compiled_per_block = torch.compile(per_block)
    _train(compiled_per_block, per_block, args, kwargs)
    per_block_peak = _peak(compiled_per_block, args, kwargs)
    resident = static_memory_for(chkpt_opt.trace(model, args, kwargs)).resident_bytes
    budget = resident + per_block_peak
    result: dict[str, Any] = {
        "budget": budget,
        "resident": resident,
        "per_block_peak": per_block_peak,
        "reference_losses": ref_losses,
        "eager_vs_compiled": _largest_difference(eager_grads, ref_grads),
        "eager_loss_difference": max(abs(a - b) for a, b in zip(eager_losses, ref_losses)),
        "orders": {},
    }
    plan_dir = tempfile.mkdtemp(prefix="chkpt_opt_compile_")
    for order in ORDERS:
        attached = copy.deepcopy(model)
        attached.load_state_dict(initial)
        chkpt_opt.optimize(
            attached, budget=budget, time_limit_s=10, profile_times=False, plan_dir=plan_dir
        )
        if order.startswith("torch.compile"):
            compiled: Any = torch.compile(attached)
        else:
            attached.compile()
            compiled = attached
        losses, grads = _train(compiled, attached, args, kwargs)
        peak = _peak(compiled, args, kwargs)
        attachment = chkpt_opt.attachment_of(attached)
        runner = attachment.last_runner
        twin = attachment.compiled.twin
        result["orders"][order] = {
            "losses": losses,
            "grads_vs_compiled": _largest_difference(grads, ref_grads),
            "peak": peak,
            "predicted_peak": runner.predicted_peak_bytes,
            "runner_resident": runner.resident_bytes,
            "regions": len(runner.schedule.regions),
            "nested": bool(runner.schedule.nested),
            "unpacked": len(runner.schedule.unpacked),
            "source": runner.source,
            "calls": attachment.stats.calls,
            "solves": attachment.stats.solves,
            "eager_runners": len(attachment.runners),
            "compiled_runners": len(twin.runners),
        }
    return result


# -- the tests ----------------------------------------------------------------------------------


def _run_in_subprocess(name: str) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.attachment.test_compile", name],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, (
        f"exit {done.returncode} (a negative code is a signal: -11 a segmentation fault)\n"
        f"{done.stderr[-4000:]}"
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "name",
    # the Llama compiles for minutes on 2 cores: behind -m slow, the GPT in every run
    [pytest.param(n, marks=pytest.mark.slow) if n == "llama" else n for n in sorted(MODELS)],
)
def test_compiled_training_runs_the_plan_within_the_per_block_peak(name: str) -> None:
    result = _run_in_subprocess(name)
    budget, resident = result["budget"], result["resident"]
    for order, got in result["orders"].items():
        # The plan recomputes (the budget is below keeping everything) with regions the
        # compiled path runs, planned outside dynamo (planned again where a compiled step
        # measured above the budget), then served: one runner for every call.
        assert got["regions"] > 0 and not got["nested"] and got["unpacked"] == 0, order
        assert got["calls"] >= STEPS + 1, order
        assert got["eager_runners"] == 0 and got["compiled_runners"] == 1, order
        # The compiled original's losses and gradients, within what compiling the
        # original itself changes (float reordering).
        tolerance = max(10 * result["eager_vs_compiled"], 1e-5)
        assert got["grads_vs_compiled"] <= tolerance, (order, got, result["eager_vs_compiled"])
        for loss, expected in zip(got["losses"], result["reference_losses"], strict=True):
            assert loss == pytest.approx(expected, rel=1e-5, abs=1e-6), order
        # Within the budget: the measured step on top of the resident bytes.
        assert got["runner_resident"] == resident, order
        assert got["predicted_peak"] <= budget, order
        assert resident + got["peak"] <= budget, (order, got["peak"], result["per_block_peak"])
    # The second order found the plans the first one made for the compiled path on disk.
    first, second = result["orders"].values()
    assert first["solves"] >= 1 and (second["solves"], second["source"]) == (0, "stored")


def _calls_measuring(
    monkeypatch: pytest.MonkeyPatch,
    peaks: list[Callable[[Any], int]],
    budget: int,
    *,
    ahead: bool = False,
) -> tuple[CompiledCalls, tuple[Any, ...]]:
    """The compiled calls of a small chain under ``budget``, whose compiled steps measure
    ``peaks(runner)`` in turn (the planning is real; nothing is compiled: the measurement,
    which the subprocess tests run for real, is replaced)."""
    from chkpt_opt import zoo

    model, args, _ = zoo.mlp(width=64, depth=8, batch=256)
    chkpt_opt.optimize(
        model,
        args if ahead else None,
        budget=budget,
        optimizer=None,
        profile_times=False,
        time_limit_s=5,
    )
    measured = iter(peaks)
    monkeypatch.setattr(
        CompiledCalls, "_measure", lambda self, runner, a, k: next(measured)(runner)
    )
    return compiled_calls(chkpt_opt.attachment_of(model)), args


def test_a_compiled_step_measured_over_the_budget_is_planned_again_below_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    budget = 10**7
    over = [lambda r: budget - r.resident_bytes + 1000, lambda r: 5000]
    calls, args = _calls_measuring(monkeypatch, over, budget)
    runner = calls.runner_for(args, {})
    assert calls.twin.budget.total_bytes == budget - 1000
    assert runner.predicted_peak_bytes <= budget - 1000
    assert calls.twin.stats.captures == 2 and calls.measured == {id(runner.module): 5000}
    # Measured once: later calls are served without measuring (no peaks left to take).
    assert calls.runner_for(args, {}) is runner


def test_a_plan_made_eagerly_that_the_compiled_path_runs_is_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    budget = 10**7
    calls, args = _calls_measuring(monkeypatch, [lambda r: 5000], budget, ahead=True)
    runner = calls.runner_for(args, {})
    assert runner.source == "reused"
    assert (calls.twin.stats.solves, calls.twin.stats.reuses) == (1, 1)


def test_a_compiled_step_that_stays_over_the_budget_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    budget = 10**7
    calls, args = _calls_measuring(monkeypatch, [lambda r: budget] * MEASURED_PLANS, budget)
    with pytest.raises(InfeasibleBudgetError, match=r"under torch\.compile the step of MLP"):
        calls.runner_for(args, {})
    assert calls.twin.stats.captures == MEASURED_PLANS


def test_no_room_for_what_compiling_adds_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    budget = 10**7
    # Over by all but 100 bytes of the activations' room: no schedule fits below that.
    over = [lambda r: 2 * (budget - r.resident_bytes) - 100]
    calls, args = _calls_measuring(monkeypatch, over, budget)
    with pytest.raises(InfeasibleBudgetError, match=r"under torch\.compile .* Planning below"):
        calls.runner_for(args, {})


def test_fullgraph_is_refused_by_dynamo_with_the_reason() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    chkpt_opt.optimize(net, budget=10**9, optimizer=None, profile_times=False)
    compiled = torch.compile(net, fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="without fullgraph=True"):
        compiled(torch.randn(4, 8))
    torch._dynamo.reset()


def test_a_model_compiled_before_the_plan_is_attached_is_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ChkptOptError, match=r"torch\.compile\(chkpt_opt\.optimize"):
        chkpt_opt.optimize(torch.compile(model), budget=10**9)


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1])))
