"""Staged schedules run by codegen (:mod:`chkpt_opt.codegen.staged`) on small CPU models:
gradients (parameters and inputs) bitwise the original's, the measured peak equal to the
simulated one to the byte, the plain forward without gradients, and the refusals."""

from __future__ import annotations

import copy
import gc
import random
from collections.abc import Callable
from typing import NamedTuple

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
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.memory_model.staged import recomputable_ops, staged_schedule


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


class NormMLP(nn.Module):
    """Linear -> layer norm -> ReLU, a residual block with a layer norm and a GELU, a head,
    and an unreduced cross-entropy then averaged (so the cross-entropy is no step output)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 64)
        self.ln1 = nn.LayerNorm(64)
        self.l2 = nn.Linear(64, 64)
        self.ln2 = nn.LayerNorm(64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.ln1(self.l1(x)))
        h = h + F.gelu(self.ln2(self.l2(h)))
        return F.cross_entropy(self.head(h), target, reduction="none").mean()


class ConvNorm(nn.Module):
    """conv -> group norm -> relu -> max-pool, a residual conv, a mean over the image, a
    linear head and a cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.gn(self.c1(x))), 2)
        h = F.relu(self.c2(h)) + h
        return F.cross_entropy(self.head(h.mean((2, 3))), target)


class DropoutMLP(nn.Module):
    """Linear -> dropout -> ReLU -> linear -> GELU -> dropout -> head, an MSE loss: random
    ops a stage recomputes under the generator's state of their forward call."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 64)
        self.l2 = nn.Linear(64, 64)
        self.head = nn.Linear(64, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.drop(self.l1(x)))
        return F.mse_loss(self.head(self.drop(F.gelu(self.l2(h)))), target)


Case = tuple[nn.Module, tuple[torch.Tensor, ...], Traced, dict[int, list[torch.Tensor]]]
"""A model, its inputs, its trace and the gradients of its own step by the number of CPU
threads (kernels sum in another order on another number of threads)."""

MAKERS: dict[str, Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "mlp": lambda: (MLP(), (torch.randn(256, 16), torch.randn(256, 4))),
    "pool_skip": lambda: (PoolSkip(), (torch.randn(2, 3, 32, 32), torch.randn(2, 4, 16, 16))),
    "shared_tanh": lambda: (SharedTanh(), (torch.randn(256, 16),)),
    "norm_mlp": lambda: (NormMLP(), (torch.randn(512, 16), torch.randint(0, 10, (512,)))),
    "conv_norm": lambda: (ConvNorm(), (torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)))),
    "dropout_mlp": lambda: (DropoutMLP().train(), (torch.randn(256, 16), torch.randn(256, 4))),
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


class Measured(NamedTuple):
    """One step's bytes: the forward's peak, those alive when it ends, the backward's peak
    (from them); and the gradients of the parameters and of the input."""

    forward: int
    held: int
    backward: int
    grads: list[torch.Tensor]


def _step(model: nn.Module, module: nn.Module, args: tuple) -> Measured:
    """One step of ``module`` (the step of :func:`~chkpt_opt.measurement.step.measure_step`,
    with the same exact storage tracker)."""
    leaves = [*model.parameters(), args[0]]
    for t in leaves:
        t.grad = None
    torch.manual_seed(0)  # the random ops draw the same numbers in every step
    with StorageTracker() as tracker:
        out = module(*args)
        forward, held = tracker.peak_bytes, tracker.live_bytes
        tracker.reset_peak()
        torch.autograd.backward([out], [torch.ones_like(out)])
    return Measured(forward, held, tracker.peak_bytes, [t.grad.clone() for t in leaves])


def _peaks(case: Case, stages: dict[str, list[str]]) -> tuple[int, int]:
    """Runs ``stages`` on ``case``: asserts bitwise gradients, and the simulated peaks of the
    forward and of the backward and bytes alive between them, to the byte; returns the two
    peaks."""
    model, args, traced, references = case
    threads = torch.get_num_threads()
    if threads not in references:
        references[threads] = _step(model, model, args).grads
    reference = references[threads]
    schedule = Schedule(staged=staged_schedule(traced.graph, stages))
    module = rewrite_module(traced.captured.fresh_module(), traced.graph, schedule)
    forward, held, backward, grads = _step(model, module, args)
    assert all(torch.equal(a, b) for a, b in zip(reference, grads)), stages
    profile = simulate(traced.graph, schedule)
    start = next(i for i, p in enumerate(profile.timeline) if p.kind == "bwd_start")
    predicted = [
        max(p.during_bytes for p in part)
        for part in (profile.timeline[:start], profile.timeline[start:])
    ]
    assert [forward, backward] == predicted, stages
    assert held == profile.timeline[start - 1].after_bytes, stages
    assert max(forward, backward) == profile.peak_bytes
    return forward, backward


def _check(case: Case, stages: dict[str, list[str]]) -> int:
    """:func:`_peaks`, returning the step's peak."""
    return max(_peaks(case, stages))


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
    # the ops that save buffers of their own, and those buffers' bytes
    for name, buffers in {
        "pool_skip": {"max_pool2d": [32768]},  # the indices (int64)
        "norm_mlp": {  # mean and rstd per row; the log-softmax and the total weight
            "layer_norm": [2048, 2048],
            "layer_norm_1": [2048, 2048],
            "cross_entropy_loss": [20480, 4],
        },
        "conv_norm": {
            "group_norm": [32, 32],
            "max_pool2d": [65536],
            "cross_entropy_loss": [160, 4],
        },
    }.items():
        graph = models[name][2].graph
        found = {
            n: [b for s, b in graph.nodes[n]["saved"].items() if s.startswith(f"{n}:buf")]
            for n in graph
        }
        assert {n: b for n, b in found.items() if b} == buffers, name
    assert "cross_entropy_loss" in recomputable_ops(models["norm_mlp"][2].graph)


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
    # a max-pool rebuilt before the conv reading it: its backward unpacks the rebuilt
    # indices, the forward's die right after the forward
    "pool_indices": ("pool_skip", {"conv2d_1": ["max_pool2d"]}),
    # a layer norm's mean and rstd rebuilt with it, for the linear after it and its own
    # backward; the second one's with the residual branch
    "layer_norm_stats": ("norm_mlp", {"linear_1": ["layer_norm", "relu"]}),
    "layer_norm_branch": ("norm_mlp", {"add": ["linear_1", "layer_norm_1", "gelu"]}),
    # rebuilt twice before its backward: the first rebuild's buffers die with their step
    "layer_norm_twice": ("norm_mlp", {"add": ["layer_norm"], "linear_1": ["layer_norm"]}),
    # rebuilt after its backward: nothing uses its buffers (they die with the step)
    "layer_norm_late": ("norm_mlp", {"linear": ["layer_norm"]}),
    # the cross-entropy's log-softmax and total weight rebuilt before its own backward
    "cross_entropy": ("norm_mlp", {"mean": ["cross_entropy_loss"]}),
    "cross_entropy_chain": ("norm_mlp", {"mean": ["add", "linear_2", "cross_entropy_loss"]}),
    # dropouts recomputed under their forward call's generator state: the first for the
    # linear reading it, the second twice (for the head, then for its own backward)
    "dropout": ("dropout_mlp", {"linear_1": ["dropout", "relu"]}),
    "dropout_twice": ("dropout_mlp", {"linear_2": ["dropout_1"], "dropout_1": ["dropout_1"]}),
    # a group norm and a pool rebuilt together; the pool again for its own backward
    "group_norm_pool": (
        "conv_norm",
        {"add": ["group_norm", "relu", "max_pool2d"], "max_pool2d": ["max_pool2d"]},
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


def _random_stages(graph, rng: random.Random) -> dict[str, list[str]]:
    order = ordered_nodes(graph)
    # stages at ops with an autograd node of their own (not a getitem or a pass-through)
    stages = [n for n in order if graph.nodes[n]["has_backward"] and graph.nodes[n]["outputs"]]
    ops = sorted(recomputable_ops(graph), key=order.index)
    return {
        b: rng.sample(ops, rng.randint(1, min(4, len(ops))))
        for b in rng.sample(stages, rng.randint(1, min(4, len(stages))))
    }


@pytest.mark.parametrize("model", list(MAKERS))
def test_random_staged_schedules_run_as_simulated(models, model: str) -> None:
    rng = random.Random(model)
    graph = models[model][2].graph
    peaks = set()
    rebuilt_buffers = 0  # schedules whose backward unpacks a rebuilt buffer of an op's own
    for _ in range(12):
        stages = _random_stages(graph, rng)
        plan = staged_plan(graph, Schedule(staged=staged_schedule(graph, stages)))
        rebuilt_buffers += any(sid.startswith(f"{n}:buf") for n, sid in plan.handles)
        peaks.add(_check(models[model], stages))
    assert len(peaks) > 1
    if any(":buf" in sid for n in graph for sid in graph.nodes[n]["saved"]):
        assert rebuilt_buffers >= 2


def test_a_rebuilt_max_pool_re_creates_its_indices(models) -> None:
    model, args, traced, _ = case = models["pool_skip"]
    stages = {"conv2d_1": ["max_pool2d", "relu_1", "conv2d_2"]}
    plan = staged_plan(traced.graph, Schedule(staged=staged_schedule(traced.graph, stages)))
    assert plan.buffers == {"max_pool2d": (("max_pool2d:buf0", 32768),)}
    assert plan.handles[("max_pool2d", "max_pool2d:buf0")] == ("max_pool2d:buf0", 0)
    # the forward's indices die right after the forward (the eager step holds them to the
    # pool's backward). Before a recomputation re-created them, this schedule measured
    # 163840 and 222356 bytes (the rebuild's indices on top of the forward's kept ones).
    eager_forward = _step(model, model, args).forward
    assert _peaks(case, stages) == (eager_forward - 32768, 208308) == (131072, 208308)


def test_a_rebuilt_layer_norm_re_creates_its_statistics(models) -> None:
    model, args, traced, _ = case = models["norm_mlp"]
    graph = traced.graph
    stages = NAMED["layer_norm_stats"][1]
    plan = staged_plan(graph, Schedule(staged=staged_schedule(graph, stages)))
    stats = (("layer_norm:buf0", 2048), ("layer_norm:buf1", 2048))
    assert plan.buffers == {"layer_norm": stats}
    for sid, _ in stats:
        assert plan.handles[("layer_norm", sid)] == (sid, 0)
    # the rebuilt statistics replace the forward's, which die with the forward's layer norm:
    # the forward's peak (at the residual's add) is theirs lower than the eager step's
    eager = _step(model, model, args)
    eager_forward, eager_backward = eager.forward, eager.backward
    assert _peaks(case, stages)[0] == eager_forward - 2 * 2048
    # rebuilt after its backward: the backward unpacks the forward's, kept as eagerly
    late = NAMED["layer_norm_late"][1]
    plan = staged_plan(graph, Schedule(staged=staged_schedule(graph, late)))
    assert not any(saver == "layer_norm" for saver, _ in plan.handles)
    assert _peaks(case, late) == (eager_forward, eager_backward)


def test_buffers_other_than_the_traced_ones_are_refused(models) -> None:
    # a graph whose layer norm saw a second statistic of other bytes (another trace)
    _, args, traced, _ = models["norm_mlp"]
    graph = copy.deepcopy(traced.graph)
    graph.nodes["layer_norm"]["saved"]["layer_norm:buf1"] = 4096
    schedule = Schedule(staged=staged_schedule(graph, NAMED["layer_norm_stats"][1]))
    module = rewrite_module(traced.captured.fresh_module(), graph, schedule)
    with pytest.raises(
        ScheduleError,
        match=r"op 'layer_norm' saved buffers of its own of \[2048, 2048\] bytes in the "
        r"forward where its trace saw \[2048, 4096\].*drop 'layer_norm'",
    ):
        module(*args)
    # a storage it owns and saves under another name than the tracer's: refused at codegen
    saved = graph.nodes["layer_norm"]["saved"]
    saved["layer_norm:stats"] = saved.pop("layer_norm:buf1")
    with pytest.raises(ScheduleError, match=r"'layer_norm' owns storages \['layer_norm:stats'\]"):
        rewrite_module(traced.captured.fresh_module(), graph, schedule)
    # at a recomputation: one buffer where the trace saw two
    schedule = Schedule(staged=staged_schedule(traced.graph, NAMED["layer_norm_stats"][1]))
    run = staged_runtime.StagedRun(staged_plan(traced.graph, schedule))
    with pytest.raises(ScheduleError, match=r"\[2048\] bytes at a recomputation"):
        run._own_buffers("layer_norm", [torch.zeros(512)], (), (), "at a recomputation")
    # a smaller call (its output half the traced bytes: a smaller shape a symbolic capture
    # serves): buffers no larger than traced are its own; a larger one, or one fewer, is not
    half = torch.zeros(run.plan.output_bytes["layer_norm"] // 8)
    found = run._own_buffers(
        "layer_norm", [torch.zeros(256), torch.zeros(256)], (), half, "at a recomputation"
    )
    assert [sid for _, sid in found] == ["layer_norm:buf0", "layer_norm:buf1"]
    for packs in ([torch.zeros(1024), torch.zeros(256)], [torch.zeros(256)]):
        with pytest.raises(ScheduleError, match=r"bytes at a recomputation"):
            run._own_buffers("layer_norm", packs, (), half, "at a recomputation")


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
    """conv -> relu -> max-pool -> conv -> sum."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(F.max_pool2d(torch.relu(self.c1(x)), 2)).sum()


def test_a_recomputation_runs_under_the_forwards_autocast_state() -> None:
    # the forward runs under CPU autocast (bf16 convolutions), the backward outside it: the
    # rebuilt pool that the second conv saves must be bf16, as the forward computed it, and
    # the pool's backward takes the rebuilt indices
    torch.manual_seed(0)
    model, args = TwoConvs(), (torch.randn(2, 3, 16, 16),)
    traced = trace_model(model, args, {})
    stages = {"conv2d_1": ["conv2d", "relu", "max_pool2d"]}
    schedule = Schedule(staged=staged_schedule(traced.graph, stages))
    plan = staged_plan(traced.graph, schedule)
    assert plan.handles[("max_pool2d", "max_pool2d:buf0")] == ("max_pool2d:buf0", 2)
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


def test_a_step_recomputing_buffers_leaves_nothing_alive(models) -> None:
    # the tensors a recomputation captures hold, through their graph, the hook that holds
    # the list they are in: a cycle through C++ that the garbage collector cannot see
    model, args, traced, _ = models["norm_mlp"]
    schedule = Schedule(staged=staged_schedule(traced.graph, NAMED["cross_entropy_chain"][1]))
    module = rewrite_module(traced.captured.fresh_module(), traced.graph, schedule)
    gc.disable()
    try:
        with StorageTracker() as tracker:
            module(*args).backward()
            for t in [*model.parameters(), args[0]]:
                t.grad = None
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
    _, _, traced, _ = models["mlp"]
    graph = traced.graph
    # broadcast_tensors (before the MSE loss) returns the head's output as it is
    assert graph.nodes["broadcast_tensors"]["has_backward"]
    schedule = Schedule(staged=staged_schedule(graph, {"broadcast_tensors": ["relu_2"]}))
    # the check refuses it before codegen (it makes no storage of its own) ...
    with pytest.raises(ScheduleError, match="'broadcast_tensors' makes no storage of its own"):
        rewrite_module(traced.captured.fresh_module(), graph, schedule)
    # ... and the executor would too, where a graph and the run disagreed
    run = staged_runtime.StagedRun(staged_plan(graph, schedule))
    head = torch.zeros(2, requires_grad=True) * 2
    run._hook("linear_3", head)
    with pytest.raises(
        ScheduleError,
        match=r"'broadcast_tensors' returns a tensor of op 'linear_3'.*move the stage",
    ):
        run._hook("broadcast_tensors", head)
    # an output with no node at all
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


def test_a_recomputed_dropout_leaves_the_generator_as_the_original_step_does(models) -> None:
    model, args, traced, _ = models["dropout_mlp"]
    graph = traced.graph
    assert {"dropout", "dropout_1"} <= recomputable_ops(graph)
    schedule = Schedule(staged=staged_schedule(graph, NAMED["dropout_twice"][1]))
    assert staged_plan(graph, schedule).replayed == {"dropout_1": 1}
    after = []
    for module in (model, rewrite_module(traced.captured.fresh_module(), graph, schedule)):
        _step(model, module, args)
        after.append(torch.rand(4))  # the next draw after the step
    assert torch.equal(*after)


def test_a_compiled_staged_module_runs_its_stages_eagerly(models) -> None:
    """``torch.compile`` of a staged module: the staged body runs eagerly under its hooks
    (dynamo does not trace it), so the step recomputes as planned, draws the same random
    numbers and gives the original gradients."""
    import torch._dynamo

    model, args, traced, _ = models["dropout_mlp"]
    graph = traced.graph
    schedule = Schedule(staged=staged_schedule(graph, NAMED["dropout_twice"][1]))
    module = rewrite_module(traced.captured.fresh_module(), graph, schedule)
    reference, eager = _step(model, model, args), _step(model, module, args)
    torch._dynamo.reset()
    try:
        ran = _step(model, torch.compile(module, backend="aot_eager"), args)
    finally:
        torch._dynamo.reset()
    assert all(torch.equal(a, b) for a, b in zip(reference.grads, ran.grads, strict=True))
    assert (ran.forward, ran.held, ran.backward) == (eager.forward, eager.held, eager.backward)
