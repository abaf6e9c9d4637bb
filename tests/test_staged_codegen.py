"""Staged schedules run by codegen (:mod:`chkpt_opt.codegen.staged`) on small CPU models:
gradients (parameters and inputs) bitwise the original's, the measured peak equal to the
simulated one to the byte, the plain forward without gradients, and the refusals."""

from __future__ import annotations

import gc
import random
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from chkpt_opt.codegen import rewrite_module
from chkpt_opt.codegen import staged_run as staged_runtime
from chkpt_opt.codegen.staged_plan import staged_plan
from chkpt_opt.errors import ScheduleError
from chkpt_opt.export.layers import lower_to_layers
from chkpt_opt.export.sac import lower_to_sac
from chkpt_opt.graphs.costgraph import ordered_nodes
from chkpt_opt.graphs.tracer import Traced, trace_model
from chkpt_opt.graphs.tracer.storage import StorageTracker
from chkpt_opt.schedule import Schedule
from chkpt_opt.simulate import simulate
from chkpt_opt.staged import recomputable_ops, staged_schedule


class MLP(nn.Module):
    """Three linear layers with ReLUs, a head and an MSE loss."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16 if i == 0 else width, width) for i in range(3))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.relu(layer(x))
        return F.mse_loss(self.head(x), target)


class PoolSkip(nn.Module):
    """conv -> relu -> max-pool -> conv -> relu, plus the pool's output (a skip) -> conv."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.c3 = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        pooled = F.max_pool2d(F.relu(self.c1(x)), 2)
        h = F.relu(self.c2(pooled)) + pooled
        return F.mse_loss(self.c3(h), target)


class SharedTanh(nn.Module):
    """A tanh whose output three ops save: itself and the two linear layers reading it."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 64)
        self.l2 = nn.Linear(64, 64)
        self.l3 = nn.Linear(64, 64)
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(x))
        return self.head(torch.sigmoid(self.l2(h)) * self.l3(h)).sum()


Case = tuple[nn.Module, tuple[torch.Tensor, ...], Traced, dict[int, list[torch.Tensor]]]
"""A model, its inputs, its trace and the gradients of its own step by the number of CPU
threads (kernels sum in another order on another number of threads)."""

MAKERS: dict[str, Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "mlp": lambda: (MLP(), (torch.randn(256, 16), torch.randn(256, 4))),
    "pool_skip": lambda: (PoolSkip(), (torch.randn(2, 3, 32, 32), torch.randn(2, 4, 16, 16))),
    "shared_tanh": lambda: (SharedTanh(), (torch.randn(256, 16),)),
}


@pytest.fixture(scope="module")
def models() -> dict[str, Case]:
    out = {}
    for name, make in MAKERS.items():
        torch.manual_seed(0)
        model, args = make()
        args[0].requires_grad_()  # the input's gradient is compared too
        out[name] = (model, args, trace_model(model, args, {}), {})
    return out


def _step(model: nn.Module, module: nn.Module, args: tuple) -> tuple[int, int, list[torch.Tensor]]:
    """One step of ``module`` (the step of :func:`~chkpt_opt.measurement.step.measure_step`,
    with the same exact storage tracker): the peaks of the forward and of the backward (from
    the bytes alive when it starts), and the gradients of the parameters and the input."""
    leaves = [*model.parameters(), args[0]]
    for t in leaves:
        t.grad = None
    with StorageTracker() as tracker:
        out = module(*args)
        forward = tracker.peak_bytes
        tracker.reset_peak()
        torch.autograd.backward([out], [torch.ones_like(out)])
    return forward, tracker.peak_bytes, [t.grad.clone() for t in leaves]


def _check(case: Case, stages: dict[str, list[str]]) -> int:
    """Runs ``stages`` on ``case``: asserts bitwise gradients and the simulated peaks of the
    forward and of the backward, to the byte; returns the peak."""
    model, args, traced, references = case
    threads = torch.get_num_threads()
    if threads not in references:
        references[threads] = _step(model, model, args)[2]
    reference = references[threads]
    schedule = Schedule(staged=staged_schedule(traced.graph, stages))
    module = rewrite_module(traced.captured.fresh_module(), traced.graph, schedule)
    forward, backward, grads = _step(model, module, args)
    assert all(torch.equal(a, b) for a, b in zip(reference, grads)), stages
    profile = simulate(traced.graph, schedule)
    start = next(i for i, p in enumerate(profile.timeline) if p.kind == "bwd_start")
    predicted = [
        max(p.during_bytes for p in part)
        for part in (profile.timeline[:start], profile.timeline[start:])
    ]
    assert [forward, backward] == predicted, stages
    assert max(forward, backward) == profile.peak_bytes
    return profile.peak_bytes


def test_the_traced_ops_are_the_ones_the_cases_name(models) -> None:
    assert ordered_nodes(models["mlp"][2].graph)[:7] == [
        "linear", "relu", "linear_1", "relu_1", "linear_2", "relu_2", "linear_3",
    ]  # fmt: skip
    assert ordered_nodes(models["pool_skip"][2].graph)[:7] == [
        "conv2d", "relu", "max_pool2d", "conv2d_1", "relu_1", "add", "conv2d_2",
    ]  # fmt: skip
    graph = models["shared_tanh"][2].graph
    assert [n for n in graph if "tanh" in graph.nodes[n]["saved"]] == [
        "tanh",
        "linear_1",
        "linear_2",
    ]


NAMED: dict[str, tuple[str, dict[str, list[str]]]] = {
    # relu freed after the forward, rebuilt for linear_1's backward, freed, rebuilt again
    # for its own backward; its input kept until then
    "rebuilt_twice": ("mlp", {"linear_1": ["relu"], "relu": ["relu"]}),
    # a recomputation reading another one of the same stage (relu reads the linear's)
    "same_stage": ("mlp", {"linear_1": ["linear", "relu"]}),
    # a chain over two stages: relu_1, at the second stage, reads the linear_1 that the
    # first one recomputed, held in between
    "two_stages": ("mlp", {"linear_3": ["linear_1"], "linear_2": ["relu_1"]}),
    # relu_1 rebuilt for linear_2's backward (the peak), which holds it until its bias
    # gradient is reduced (the node's post-hook, not the unpack, ends the use), then again
    "held_to_post_hook": ("mlp", {"mse_loss": ["relu_1"], "relu_1": ["relu_1", "linear_3"]}),
    # two layers rebuilt from the input alone
    "from_input": ("mlp", {"linear_2": ["linear", "relu", "linear_1", "relu_1"]}),
    # the residual's sum and the conv reading it, rebuilt from the kept branches
    "residual": ("pool_skip", {"conv2d_2": ["add"], "relu_1": ["conv2d_1"]}),
    "residual_early": (
        "pool_skip",
        {"mse_loss": ["conv2d_1", "relu_1", "add"], "conv2d_1": ["conv2d", "relu"]},
    ),
    # tanh rebuilt once, then unpacked by the three ops that save it
    "three_savers": ("shared_tanh", {"linear_2": ["linear", "tanh"]}),
    # as held_to_post_hook: the first rebuild's last use is linear_2's backward, the peak
    "three_savers_post_hook": ("shared_tanh", {"linear_3": ["tanh"], "linear_1": ["tanh", "mul"]}),
    # ... or rebuilt again for the last of them
    "three_savers_rebuilt": (
        "shared_tanh",
        {"mul": ["tanh"], "linear_1": ["linear", "tanh"], "tanh": ["tanh"]},
    ),
}


@pytest.mark.parametrize("name", list(NAMED))
def test_named_schedules_run_as_simulated_with_the_original_gradients(models, name: str) -> None:
    model, stages = NAMED[name]
    _check(models[model], stages)


def test_the_plan_takes_the_latest_instance_and_the_schedules_change_the_peak(models) -> None:
    traced = models["mlp"][2]
    graph = traced.graph
    chain = staged_plan(graph, Schedule(staged=staged_schedule(graph, NAMED["two_stages"][1])))
    assert chain.reads[1]["linear_1"] == ("linear_1", 0)  # not the forward's
    twice = staged_plan(graph, Schedule(staged=staged_schedule(graph, NAMED["rebuilt_twice"][1])))
    assert twice.handles[("linear_1", "relu")] == ("relu", 0)
    assert twice.handles[("relu", "relu")] == ("relu", 1)
    assert twice.reads[0]["linear"] == twice.reads[1]["linear"] == ("linear", -1)
    # the schedules change the peak, both ways
    assert _check(models["mlp"], NAMED["same_stage"][1]) < simulate(graph, Schedule()).peak_bytes
    pool_graph = models["pool_skip"][2].graph
    assert (
        _check(models["pool_skip"], NAMED["residual_early"][1])
        > simulate(pool_graph, Schedule()).peak_bytes
    )


def _random_stages(graph, rng: random.Random, skip: frozenset[str]) -> dict[str, list[str]]:
    order = ordered_nodes(graph)
    # stages at ops with an autograd node of their own (not a getitem or a pass-through)
    stages = [n for n in order if graph.nodes[n]["has_backward"] and graph.nodes[n]["outputs"]]
    ops = sorted(recomputable_ops(graph) - skip, key=order.index)
    return {
        b: rng.sample(ops, rng.randint(1, min(4, len(ops))))
        for b in rng.sample(stages, rng.randint(1, min(4, len(stages))))
    }


@pytest.mark.parametrize("model", list(MAKERS))
def test_random_staged_schedules_run_as_simulated(models, model: str) -> None:
    rng = random.Random(model)
    skip: frozenset[str] = frozenset()
    peaks = {
        _check(models[model], _random_stages(models[model][2].graph, rng, skip)) for _ in range(12)
    }
    assert len(peaks) > 1


def test_a_rebuilt_max_pool_allocates_its_indices_too(models) -> None:
    # aten.max_pool2d makes its indices (max_pool2d:buf0, 32768 bytes here) whenever it
    # runs, also in a recomputation without gradients: the rebuild at conv2d_1's stage is
    # the backward's peak, 222356 bytes measured (the model counted 208308 before it
    # allocated the op's own buffers at a recomputation).
    assert _check(models["pool_skip"], {"conv2d_1": ["max_pool2d", "relu_1", "conv2d_2"]}) == (
        222356
    )


class MethodCalls(nn.Module):
    """Tensor methods between layers: call_method and call_module ops in an fx capture."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x).tanh()).sigmoid()).sum()


def test_a_symbolic_trace_recomputes_methods_and_modules_from_the_kept_values() -> None:
    # a method's recipe must not keep the forward tensor bound into its callee: the
    # backward's peak is then higher than predicted
    torch.manual_seed(0)
    model, args = MethodCalls(), (torch.randn(256, 16).requires_grad_(),)
    traced = trace_model(model, args, {}, method="fx")
    assert traced.captured.method == "fx"
    assert traced.graph.nodes["tanh"]["op"] == "method:tanh"
    for stages in ({"b": ["tanh"]}, {"c": ["a", "tanh"]}, {"sigmoid": ["b", "sigmoid"]}):
        _check((model, args, traced, {}), stages)


class TwoConvs(nn.Module):
    """conv -> relu -> conv -> sum."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(torch.relu(self.c1(x))).sum()


def test_a_recomputation_runs_under_the_forwards_autocast_state() -> None:
    # the forward runs under CPU autocast (bf16 convolutions), the backward outside it: the
    # rebuilt relu that the second conv saves must be bf16, as the forward computed it
    torch.manual_seed(0)
    model, args = TwoConvs(), (torch.randn(2, 3, 16, 16),)
    traced = trace_model(model, args, {})
    schedule = Schedule(staged=staged_schedule(traced.graph, {"conv2d_1": ["conv2d", "relu"]}))
    module = rewrite_module(traced.captured.fresh_module(), traced.graph, schedule)
    grads = []
    for runner in (model, module):
        for p in model.parameters():
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = runner(*args)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_forward_without_backward_leaves_nothing_alive(models) -> None:
    # a saved output kept with its grad_fn would hold its own node: a cycle through C++
    # that the garbage collector cannot see
    _, args, traced, _ = models["mlp"]
    schedule = Schedule(staged=staged_schedule(traced.graph, NAMED["rebuilt_twice"][1]))
    module = rewrite_module(traced.captured.fresh_module(), traced.graph, schedule)
    gc.disable()
    try:
        with StorageTracker() as tracker:
            out = module(*args)
            assert tracker.live_bytes > 0
            del out
            assert tracker.live_bytes == 0
    finally:
        gc.enable()


def test_without_gradients_the_forward_runs_plainly(models, monkeypatch) -> None:
    model, args, traced, _ = models["pool_skip"]
    schedule = Schedule(staged=staged_schedule(traced.graph, NAMED["residual_early"][1]))
    module = rewrite_module(traced.captured.fresh_module(), traced.graph, schedule)

    def fail(*_: object) -> None:
        raise RuntimeError("the executor ran")

    monkeypatch.setattr(staged_runtime.StagedRun, "call", fail)
    with torch.no_grad():
        assert torch.equal(module(*args), model(*args))
    with torch.inference_mode():  # how a captured module evaluates (it refuses .eval())
        assert torch.equal(module(*args), model(*args))
    # with gradients, the executor runs; its error leaves no hook behind
    with pytest.raises(RuntimeError, match="the executor ran"):
        module(*args)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_a_second_backward_over_one_forward_is_refused(models) -> None:
    _, args, traced, _ = models["mlp"]
    schedule = Schedule(staged=staged_schedule(traced.graph, NAMED["rebuilt_twice"][1]))
    module = rewrite_module(traced.captured.fresh_module(), traced.graph, schedule)
    loss = module(*args)
    loss.backward(retain_graph=True)
    with pytest.raises(ScheduleError, match=r"runs a second time.*Run the forward again"):
        loss.backward()


def test_a_stage_without_an_autograd_node_of_its_own_is_refused(models) -> None:
    _, args, traced, _ = models["mlp"]
    graph = traced.graph
    # broadcast_tensors (before the MSE loss) returns the head's output as it is
    assert graph.nodes["broadcast_tensors"]["has_backward"]
    schedule = Schedule(staged=staged_schedule(graph, {"broadcast_tensors": ["relu_2"]}))
    module = rewrite_module(traced.captured.fresh_module(), graph, schedule)
    with pytest.raises(
        ScheduleError,
        match=r"'broadcast_tensors' returns a tensor of op 'linear_3'.*move the stage",
    ):
        module(*args)
    # an output with no node at all
    run = staged_runtime.StagedRun(staged_plan(graph, schedule))
    with pytest.raises(
        ScheduleError, match="autograd node of op 'broadcast_tensors' cannot be found"
    ):
        run._hook("broadcast_tensors", torch.zeros(2, requires_grad=True))


class ScaledBuffer(nn.Module):
    """A linear layer's output scaled by a buffer that the step then updates in place."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(x) * self.scale)
        self.scale.add_(1.0)
        return y.sum()


def test_a_recomputation_whose_input_was_written_in_place_is_refused() -> None:
    torch.manual_seed(0)
    model = ScaledBuffer()
    args = (torch.randn(4, 8),)
    traced = trace_model(model, args, {})
    graph = traced.graph
    (mul,) = [n for n in graph if graph.nodes[n]["op"] == "aten.mul.Tensor"]
    assert mul in recomputable_ops(graph)
    schedule = Schedule(staged=staged_schedule(graph, {"tanh": [mul]}))
    module = rewrite_module(traced.captured.fresh_module(), graph, schedule)
    with pytest.raises(ScheduleError, match=f"an input of op '{mul}' was written in place"):
        module(*args).backward()


def test_the_compile_path_and_the_lowerings_refuse_a_staged_schedule(models) -> None:
    traced = models["mlp"][2]
    graph = traced.graph
    schedule = Schedule(staged=staged_schedule(graph, NAMED["rebuilt_twice"][1]))
    with pytest.raises(ScheduleError, match=r"staged.*Apply it eagerly"):
        rewrite_module(traced.captured.fresh_module(), graph, schedule, for_compile=True)
    with pytest.raises(ScheduleError, match=r"staged.*Run it eagerly"):
        lower_to_sac(graph, schedule, {})
    with pytest.raises(ScheduleError, match=r"staged.*Run it eagerly"):
        lower_to_layers(graph, schedule, target="huggingface")
