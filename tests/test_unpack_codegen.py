"""Recompute on unpack run by codegen (saved-tensor hooks) on a small conv net, measured on
the CPU: the measured peak equals the simulated one to the byte, gradients are bitwise the
original's, and no_grad, inference mode, retain_graph and errors in the forward are safe."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from chkpt_opt.api import plan
from chkpt_opt.codegen import rewrite_module
from chkpt_opt.codegen import unpack as unpack_codegen
from chkpt_opt.errors import ScheduleError
from chkpt_opt.graphs.tracer import Traced, trace_model
from chkpt_opt.measurement.step import measure_step
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.memory_model.unpack import unpack_candidates


class PoolNet(nn.Module):
    """conv -> relu -> max-pool -> conv -> relu -> max-pool -> conv -> MSE loss."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.c3 = nn.Conv2d(16, 8, 3, padding=1)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.c1(x)), 2)
        h = F.max_pool2d(F.relu(self.c2(h)), 2)
        return F.mse_loss(self.c3(h), target)


@pytest.fixture(scope="module")
def net() -> tuple[PoolNet, tuple[torch.Tensor, torch.Tensor], Traced]:
    torch.manual_seed(0)
    model = PoolNet()
    args = (torch.randn(4, 3, 32, 32), torch.randn(4, 8, 8, 8))
    return model, args, trace_model(model, args, {})


def _step(model: nn.Module, module: nn.Module, args: tuple) -> tuple[int, list[torch.Tensor]]:
    for p in model.parameters():
        p.grad = None
    peak = measure_step(module, args).peak_bytes
    return peak, [p.grad.clone() for p in model.parameters()]


def test_every_op_worth_unpacking_runs_as_simulated_with_the_same_gradients(net) -> None:
    model, args, traced = net
    graph = traced.graph
    _, reference = _step(model, model, args)
    found = unpack_candidates(graph, frozenset())
    assert found == ["relu", "max_pool2d", "relu_1", "max_pool2d_1", "conv2d_2"]
    keep_all = simulate(graph, Schedule()).peak_bytes
    peaks = {}
    for names in [*([v] for v in found), found]:
        schedule = Schedule(unpacked=frozenset(names))
        module = rewrite_module(traced.captured.fresh_module(), graph, schedule)
        measured, grads = _step(model, module, args)
        assert measured == simulate(graph, schedule).peak_bytes, names
        assert all(torch.equal(a, b) for a, b in zip(reference, grads)), names
        peaks[tuple(names)] = measured
    # the first pool's output (saved by the second conv) is rebuilt from the ReLU's output,
    # which the pool keeps anyway: below keep-all. A ReLU saves its own output, so its
    # recipe keeps the conv's output instead, which nothing else keeps: above keep-all.
    assert peaks[("max_pool2d",)] < keep_all < peaks[("relu",)]


def test_a_region_keeps_its_input_and_its_checkpoint_hooks_take_precedence(
    net, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, args, traced = net
    graph = traced.graph
    _, reference = _step(model, model, args)
    packed_shapes: list[tuple[int, ...]] = []
    pack = unpack_codegen._Scope.pack

    def spy(self, t: torch.Tensor):
        packed_shapes.append(tuple(t.shape))
        return pack(self, t)

    monkeypatch.setattr(unpack_codegen._Scope, "pack", spy)
    # the pool's output is the input of the region; the region's ReLU output (4, 16, 16,
    # 16), saved by the ReLU and the pool inside it, is the checkpoint's to save
    region = ("conv2d_1", "relu_1", "max_pool2d_1")
    schedule = Schedule(regions=(region,), unpacked=frozenset({"max_pool2d", "relu"}))
    module = rewrite_module(traced.captured.fresh_module(), graph, schedule)
    measured, grads = _step(model, module, args)
    assert measured == simulate(graph, schedule).peak_bytes
    assert all(torch.equal(a, b) for a, b in zip(reference, grads))
    assert packed_shapes and (4, 16, 16, 16) not in packed_shapes
    plain = Schedule(regions=(region,), unpacked=frozenset({"relu"}))
    assert simulate(graph, schedule).peak_bytes == simulate(graph, plain).peak_bytes


def test_no_grad_inference_retain_graph_and_errors(net, monkeypatch: pytest.MonkeyPatch) -> None:
    model, args, traced = net
    graph = traced.graph
    schedule = Schedule(unpacked=frozenset({"max_pool2d", "max_pool2d_1"}))
    module = rewrite_module(traced.captured.fresh_module(), graph, schedule)
    with torch.no_grad():
        assert torch.equal(module(*args), model(*args))
    with torch.inference_mode():  # how a captured module evaluates (it refuses .eval())
        assert torch.equal(module(*args), model(*args))
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    # two backward passes of one graph: every unpack after the first rebuilds again
    for p in model.parameters():
        p.grad = None
    loss = model(*args)
    loss.backward(retain_graph=True)
    loss.backward()
    reference = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    loss = module(*args)
    loss.backward(retain_graph=True)
    loss.backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(reference, model.parameters()))

    # an error in the forward (here in an unpacked op) leaves no hook behind
    def fail(*_: object) -> None:
        raise RuntimeError("an op failed")

    monkeypatch.setattr(unpack_codegen._Scope, "run", fail)
    with pytest.raises(RuntimeError, match="an op failed"):
        module(*args)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_the_compile_path_refuses_unpacked_ops(net) -> None:
    _, _, traced = net
    schedule = Schedule(unpacked=frozenset({"max_pool2d"}))
    with pytest.raises(ScheduleError, match=r"unpacks ops \(\['max_pool2d'\]\).*Apply it eagerly"):
        rewrite_module(traced.captured.fresh_module(), traced.graph, schedule, for_compile=True)


def test_a_plan_with_unpacked_ops_compiles_its_counterpart_without_them(net) -> None:
    model, args, _ = net
    made = plan(model, args, budget=10**12, optimizer=None, solver="keep_all")
    schedule = Schedule(unpacked=frozenset({"max_pool2d"}))
    forced = dataclasses.replace(
        made,
        result=dataclasses.replace(made.result, schedule=schedule),
        profile=simulate(made.graph, schedule),
    )
    assert "1 rebuilt on unpack" in forced.summary()
    counterpart = forced.for_compile()
    assert not counterpart.schedule.unpacked
    assert counterpart.profile.peak_bytes <= forced.activation_budget_bytes
    forced.apply(for_compile=True)  # the counterpart's module, no error


class SkipNet(nn.Module):
    """conv -> pool -> conv -> upsample -> concat with the first conv -> conv -> MSE loss:
    a concat of an upsample, a chain of cheap layers."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.c3 = nn.Conv2d(16, 4, 3, padding=1)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        skip = F.relu(self.c1(x))
        h = F.relu(self.c2(F.max_pool2d(skip, 2)))
        h = torch.cat([skip, F.interpolate(h, scale_factor=2.0, mode="nearest")], dim=1)
        return F.mse_loss(self.c3(h), target)


def test_a_chain_of_unpacked_ops_rebuilds_from_what_is_kept() -> None:
    torch.manual_seed(0)
    model = SkipNet()
    args = (torch.randn(4, 3, 32, 32), torch.randn(4, 4, 32, 32))
    traced = trace_model(model, args, {})
    graph = traced.graph
    _, reference = _step(model, model, args)
    cat, upsample = "cat", "upsample_nearest2d"  # the traced nodes
    assert graph.nodes[cat]["op"] == "aten.cat.default"
    assert unpack_candidates(graph, frozenset()).count(cat) == 1
    assert upsample not in unpack_candidates(graph, frozenset())  # nothing saves it
    assert upsample in unpack_candidates(graph, frozenset(), frozenset({cat}))
    peaks = {}
    for names in ({cat}, {cat, upsample}):
        schedule = Schedule(unpacked=frozenset(names))
        module = rewrite_module(traced.captured.fresh_module(), graph, schedule)
        measured, grads = _step(model, module, args)
        assert measured == simulate(graph, schedule).peak_bytes, names
        assert all(torch.equal(a, b) for a, b in zip(reference, grads)), names
        peaks[len(names)] = measured
    # the concat's recipe holds a handle on the upsample's, not its output: freed too
    assert peaks[2] < peaks[1]


class TwoConvs(nn.Module):
    """conv -> conv (which saves the first conv's output for its weight's gradient) -> sum."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(self.c1(x)).sum()


def test_a_rebuild_under_autocast_computes_as_the_forward_did() -> None:
    # the forward runs under CPU autocast (bf16 convolutions), the backward outside it: the
    # rebuilt output of the first conv, which the second saves, must be bf16 as in the
    # forward (fp32 without the forward's autocast state), so gradients stay bitwise equal
    torch.manual_seed(0)
    model = TwoConvs()
    args = (torch.randn(2, 3, 16, 16),)
    traced = trace_model(model, args, {})
    assert "conv2d" in unpack_candidates(traced.graph, frozenset())
    schedule = Schedule(unpacked=frozenset({"conv2d"}))
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
