"""Hard models under recompute: each is planned at the smallest budget the solvers reach,
trained for several AdamW steps beside an identical unoptimized copy, and compared
parameter by parameter and buffer by buffer; the measured peak is checked against the
plan. What chkpt_opt cannot handle must fail with a clear error, never a wrong gradient.

Every model is also run under a forced schedule, the whole forward pass as one recompute
region, so the interesting op is recomputed whatever the solvers choose.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

import chkpt_opt
from chkpt_opt.api import Plan, smallest_peak
from chkpt_opt.codegen import CheckpointRegion, is_recomputing, rewrite_module
from chkpt_opt.errors import ChkptOptError, ScheduleError, TraceError
from chkpt_opt.graphs.costgraph import ordered_nodes
from chkpt_opt.measurement.module_state import preserved_state
from chkpt_opt.measurement.step import measure_step
from chkpt_opt.memory_model.schedule import Schedule
from tests.conftest import smallest_plan

STEPS = 3
Context = Callable[[], contextlib.AbstractContextManager[Any]]
Covers = Callable[[dict[str, Any]], bool]


# ---- helpers ------------------------------------------------------------------------------


def fresh(args: Any) -> Any:
    """Inputs for one call: clones, so a model that writes its inputs sees the same values."""
    return tree_map_only(torch.Tensor, lambda t: t.clone(), args)


def loss_of(out: Any) -> torch.Tensor:
    """The step's loss: the sum of every differentiable output (= backward seeded with ones,
    which is the step chkpt_opt plans and measures)."""
    leaves = [
        t
        for t in tree_flatten(out)[0]
        if isinstance(t, torch.Tensor) and t.requires_grad and t.dtype.is_floating_point
    ]
    assert leaves, "the model must return something differentiable"
    return sum(t.float().sum() for t in leaves)


LIMIT_S = 8.0  # these plans need a schedule that fits, not a proof of its optimality


def smallest_budget(model: nn.Module, args: tuple, kwargs: dict | None = None) -> int:
    full = chkpt_opt.plan(
        model,
        fresh(args),
        example_kwargs=kwargs,
        budget=10**15,
        optimizer=None,
        profile_times=False,
    )
    return full.static.resident_bytes + smallest_peak(full.graph, time_limit_s=LIMIT_S).peak_bytes


def whole_forward(graph: Any) -> Schedule:
    """The forced schedule: every op of the forward pass in one recompute region."""
    return Schedule(regions=(tuple(ordered_nodes(graph)),))


def train(
    module: nn.Module,
    params_of: nn.Module,
    args: tuple,
    kwargs: dict,
    *,
    context: Context,
    reseed: Callable[[nn.Module, int], None] | None,
) -> None:
    opt = torch.optim.AdamW([p for p in params_of.parameters() if p.requires_grad], lr=1e-2)
    for step in range(STEPS):
        torch.manual_seed(1000 + step)
        if reseed is not None:
            reseed(params_of, step)
        opt.zero_grad(set_to_none=True)
        with context():
            loss = loss_of(module(*fresh(args), **kwargs))
        loss.backward()
        opt.step()


def assert_same_state(a: nn.Module, b: nn.Module, *, rtol: float | None = None) -> None:
    """Parameters and buffers equal bitwise (or within ``rtol`` of the largest value)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        x, y = sa[key], sb[key]
        if rtol is None or not x.dtype.is_floating_point:
            assert torch.equal(x, y), (key, (x.double() - y.double()).abs().max().item())
        else:
            scale = x.abs().max().item() or 1.0
            assert (x - y).abs().max().item() <= rtol * scale, key
    for (key, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p.grad is None) == (q.grad is None), key


def check_peak(
    plan: Plan, model: nn.Module, optimized: nn.Module, args: tuple, kwargs: dict, context: Context
) -> int:
    """Measured forward+backward peak within 3% of the plan, whole step within the budget."""
    with preserved_state(model), context():
        torch.manual_seed(0)
        measured = measure_step(optimized, fresh(args), kwargs).peak_bytes
    for p in model.parameters():
        p.grad = None
    predicted = plan.profile.peak_bytes
    assert abs(measured - predicted) <= 0.03 * measured, (measured, predicted)
    assert plan.static.resident_bytes + measured <= plan.budget.total_bytes, (
        plan.static.resident_bytes + measured,
        plan.budget.total_bytes,
    )
    return measured


def check_hard_model(
    make: Callable[[], nn.Module],
    args: tuple,
    kwargs: dict | None = None,
    *,
    covers: Covers,
    context: Context = contextlib.nullcontext,
    reseed: Callable[[nn.Module, int], None] | None = None,
    check_memory: bool = True,
) -> tuple[Plan, nn.Module, nn.Module]:
    """Plans ``make()`` at the smallest budget, checks that a recompute region covers an op
    for which ``covers(attrs)`` holds, checks the peak, and trains it beside a copy; then
    does the same (without the memory check) under the whole-forward schedule.

    Returns the plan, the optimized module and the model it was made of (both trained).
    """
    kwargs = kwargs or {}
    torch.manual_seed(0)
    initial = make().train()
    reference, model = copy.deepcopy(initial), copy.deepcopy(initial)
    with context():
        plan = smallest_plan(model, fresh(args), kwargs, time_limit_s=LIMIT_S)
    covered = [n for n in plan.schedule.recomputed_nodes() if covers(plan.graph.nodes[n])]
    assert covered, f"no recompute region covers the op under test: {plan.schedule.regions}"
    optimized = plan.apply()
    if check_memory:
        check_peak(plan, model, optimized, args, kwargs, context)
    train(reference, reference, args, kwargs, context=context, reseed=reseed)
    train(optimized, model, args, kwargs, context=context, reseed=reseed)
    assert_same_state(reference, model)

    # The forced schedule: the whole forward pass is recomputed.
    reference, forced_model = copy.deepcopy(initial), copy.deepcopy(initial)
    with context():
        graph_plan = chkpt_opt.plan(
            forced_model,
            fresh(args),
            example_kwargs=kwargs,
            budget=10**15,
            optimizer=None,
            profile_times=False,
        )
    forced = rewrite_module(
        graph_plan.traced.captured.fresh_module(), graph_plan.graph, whole_forward(graph_plan.graph)
    )
    train(reference, reference, args, kwargs, context=context, reseed=reseed)
    train(forced, forced_model, args, kwargs, context=context, reseed=reseed)
    assert_same_state(reference, forced_model)
    return plan, optimized, model


def op_is(*fragments: str) -> Covers:
    return lambda attrs: any(f in attrs["op"] for f in fragments)


def from_module(*paths: str) -> Covers:
    return lambda attrs: any(attrs["module_path"].startswith(p) for p in paths)


# ---- random ops ---------------------------------------------------------------------------


class Noisy(nn.Module):
    """Dropout, additive uniform noise and a bernoulli mask in every layer."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self.drop(layer(x))
            x = x + 0.1 * torch.rand_like(x)
            x = x * torch.bernoulli(torch.full_like(x, 0.8))
            x = torch.tanh(x + 0.05 * torch.randn_like(x))
        return x.pow(2).mean()


def test_dropout_and_random_ops_draw_the_same_numbers_on_recompute() -> None:
    plan, _, _ = check_hard_model(Noisy, (torch.randn(256, 64),), covers=lambda a: a["is_random"])
    random_ops = {
        plan.graph.nodes[n]["op"]
        for n in plan.schedule.recomputed_nodes()
        if plan.graph.nodes[n]["is_random"]
    }
    assert len(random_ops) >= 2, random_ops


class GeneratorNoise(nn.Module):
    """Random ops drawing from the model's own torch.Generator, which checkpoint's
    preserve_rng_state does not replay."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
            x = x * torch.rand(x.shape, generator=self.gen)
        return x.sum()


def test_random_ops_with_an_explicit_generator_replay_its_state() -> None:
    def reseed(model: nn.Module, step: int) -> None:
        model.gen.manual_seed(step)

    check_hard_model(
        GeneratorNoise, (torch.randn(256, 64),), covers=lambda a: a["is_random"], reseed=reseed
    )


# ---- batch norm ---------------------------------------------------------------------------


class BatchNormNet(nn.Module):
    """BatchNorm2d modules, one of them used twice per step, and a functional batch norm on
    buffers of the model."""

    def __init__(self, channels: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.convs = nn.ModuleList(
            nn.Conv2d(channels, channels, 3, padding=1) for _ in range(depth)
        )
        self.norms = nn.ModuleList(nn.BatchNorm2d(channels) for _ in range(depth))
        self.shared = nn.BatchNorm2d(channels, momentum=0.3)
        self.register_buffer("mean", torch.zeros(channels))
        self.register_buffer("var", torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv, norm in zip(self.convs, self.norms):
            x = torch.relu(norm(conv(x)))
            x = self.shared(x)
        x = F.batch_norm(x, self.mean, self.var, training=True, momentum=0.2)
        return x.pow(2).mean()


def test_batch_norm_statistics_are_updated_once_per_step() -> None:
    plan, _, _ = check_hard_model(
        BatchNormNet,
        (torch.randn(8, 8, 16, 16),),
        covers=lambda a: "batch_norm" in a["op"] and a["is_stateful"],
    )
    # The reference trained 3 steps: num_batches_tracked is 3, the shared norm's 6 (twice a
    # step); assert_same_state compared them, running_mean/var included, bit for bit.
    assert any("batch_norm" in plan.graph.nodes[n]["op"] for n in plan.schedule.recomputed_nodes())


# ---- in-place ops -------------------------------------------------------------------------


class InPlace(nn.Module):
    """relu_, add_, mul_ on activations, and nn.ReLU(inplace=True)."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(x)
            h.mul_(0.5)
            h.add_(x)
            h.relu_()
            x = h * 2
            x.add_(1.0)
            x = self.act(x) - 0.5
        return x.pow(2).mean()


def test_in_place_ops_inside_and_at_region_boundaries() -> None:
    check_hard_model(InPlace, (torch.randn(256, 64),), covers=lambda a: a["is_inplace"])


def test_every_region_boundary_the_graph_allows_keeps_the_gradients() -> None:
    """Regions as small as the cut flags allow: every boundary is exercised."""
    torch.manual_seed(0)
    initial = InPlace()
    reference, model = copy.deepcopy(initial), copy.deepcopy(initial)
    args = (torch.randn(64, 64),)
    plan = chkpt_opt.plan(model, args, budget=10**15, optimizer=None, profile_times=False)
    graph = plan.graph
    order = ordered_nodes(graph)
    cuts = [i + 1 for i, n in enumerate(order) if graph.nodes[n]["cut_after_ok"]]
    spans = list(zip([0, *cuts[:-1]], cuts))
    schedule = Schedule.from_spans(graph, spans)
    assert any(graph.nodes[r[-1]]["is_inplace"] for r in schedule.regions)
    optimized = rewrite_module(plan.traced.captured.fresh_module(), graph, schedule)
    train(reference, reference, args, {}, context=contextlib.nullcontext, reseed=None)
    train(optimized, model, args, {}, context=contextlib.nullcontext, reseed=None)
    assert_same_state(reference, model)


# ---- state written in place during the step ----------------------------------------------


class StateUpdates(nn.Module):
    """Buffers updated in place during forward: a running average updated by a chain of two
    in-place ops, then read; a counter (``+=`` on a buffer); a scale read early and updated
    in a later layer; an average updated inside ``torch.no_grad()``."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.register_buffer("ema", torch.zeros(width))
        self.register_buffer("ema_ng", torch.zeros(width))
        self.register_buffer("scale", torch.ones(width))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 0:
                x = x * torch.sigmoid(self.scale)  # read here, updated below
            if i == 1:
                self.ema.mul_(0.9).add_(x.detach().mean(0), alpha=0.1)
                self.count += 1
                x = x * torch.sigmoid(self.ema)
                with torch.no_grad():
                    self.ema_ng.mul_(0.5).add_(x.mean(0), alpha=0.5)
                x = x + self.ema_ng
            if i == 2:
                self.scale.mul_(1.5)
        return x.pow(2).mean()


def test_buffers_updated_in_place_are_updated_once_and_read_as_in_the_forward() -> None:
    """Before the fix: the running averages were updated twice per step (their chain of
    in-place ops ran again on recompute), and a buffer read before an in-place update later
    in the step was recomputed from its updated value: wrong gradients, silently."""
    plan, optimized, model = check_hard_model(
        StateUpdates,
        (torch.randn(512, 64),),
        covers=lambda a: a["is_stateful"],
        check_memory=False,
    )
    # The snapshots of state written later in the step are small and not in the plan
    # (see test_state_snapshots_are_not_in_the_plan): at most the bytes of the buffers.
    snapshot_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    assert any(r.snapshot for r in optimized.modules() if isinstance(r, CheckpointRegion))
    with preserved_state(model):
        measured = measure_step(optimized, (torch.randn(512, 64),), {}).peak_bytes
    assert abs(measured - plan.profile.peak_bytes) <= 0.03 * measured
    assert plan.static.resident_bytes + measured <= plan.budget.total_bytes + snapshot_bytes


class ReadThenUpdated(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.register_buffer("scale", torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 0:
                x = x * torch.sigmoid(self.scale)
            if i == 2:
                self.scale.mul_(1.5)
        return x.pow(2).mean()


@pytest.mark.xfail(
    strict=True,
    reason="known gap: the copy of a buffer that a region reads and a later op updates in "
    "place (codegen's snapshot) is not modelled by the cost graph/simulator, so a plan at "
    "the exact smallest budget can exceed it by the buffer's size",
)
def test_state_snapshots_are_not_in_the_plan() -> None:
    torch.manual_seed(0)
    model = ReadThenUpdated()
    args = (torch.randn(512, 64),)
    plan = chkpt_opt.plan(model, args, budget=10**15, optimizer=None, profile_times=False)
    schedule = whole_forward(plan.graph)
    optimized = rewrite_module(plan.traced.captured.fresh_module(), plan.graph, schedule)
    predicted = chkpt_opt.simulate(plan.graph, schedule).peak_bytes
    with preserved_state(model):
        measured = measure_step(optimized, args, {}).peak_bytes
    assert measured <= predicted


class WritesItsInput(nn.Module):
    """Adds its input ``y`` to every layer, and doubles ``y`` in place half way."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x)) + y
            if i == 1:
                y.mul_(2)
        return x.pow(2).mean()


def test_model_that_writes_its_input_in_place() -> None:
    """Before the fix: checkpoint kept the input as it was passed and failed its version
    check on recompute (or, routed around checkpoint, recomputed from the doubled input)."""
    args = (torch.randn(512, 64), torch.randn(512, 64))
    plan, optimized, model = check_hard_model(
        WritesItsInput, args, covers=lambda a: a["op"] == "aten.add.Tensor", check_memory=False
    )
    # Regions that read y before it is doubled keep a copy of it, which the plan does not
    # count (test_state_snapshots_are_not_in_the_plan): at most one copy of y.
    with preserved_state(model):
        measured = measure_step(optimized, fresh(args), {}).peak_bytes
    copy_of_y = args[1].numel() * args[1].element_size()
    assert plan.profile.peak_bytes <= measured <= plan.profile.peak_bytes + copy_of_y


# ---- shared and frozen parameters ---------------------------------------------------------


class TiedLm(nn.Module):
    """An embedding tied with the output head, and one Linear applied twice."""

    def __init__(self, vocab: int = 128, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.shared = nn.Linear(width, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.shared(self.emb(ids)))
        for layer in self.layers:
            x = torch.tanh(layer(x))
        x = torch.tanh(self.shared(x))
        return F.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


def test_tied_and_shared_weights_accumulate_their_gradients() -> None:
    _plan, optimized, model = check_hard_model(
        TiedLm, (torch.randint(0, 128, (16, 32)),), covers=from_module("shared", "emb", "head")
    )
    assert model.head.weight is model.emb.weight
    assert len(list(optimized.parameters())) == len(list(model.parameters()))


class PartlyFrozen(nn.Module):
    def __init__(self, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        for layer in list(self.layers)[:2]:
            layer.requires_grad_(False)
        self.layers[4].weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


def test_frozen_parameters_get_no_gradient() -> None:
    _plan, optimized, model = check_hard_model(
        PartlyFrozen,
        (torch.randn(512, 64),),
        covers=from_module("layers.0", "layers.1", "layers.4"),
    )
    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    loss_of(optimized(torch.randn(512, 64))).backward()
    for name, p in model.named_parameters():
        assert (p.grad is None) == (not p.requires_grad), name


# ---- mixed precision ----------------------------------------------------------------------


class AutocastInside(nn.Module):
    """float32 layers around an autocast (bfloat16) block inside forward."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.pre = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.mixed = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.post = nn.ModuleList(nn.Linear(width, width) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.pre:
            x = torch.tanh(layer(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for layer in self.mixed:
                x = torch.tanh(layer(x))
        x = x.float()
        for layer in self.post:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


def test_autocast_inside_forward_trains_like_the_model() -> None:
    """torch.export keeps the autocast block as one higher-order op; it trains bit for bit
    like the model, also recomputed (forced schedule), within the budget."""
    torch.manual_seed(0)
    args = (torch.randn(512, 64),)
    graph = chkpt_opt.trace(AutocastInside(), args)
    assert any("wrap_with_autocast" in a["op"] for _, a in graph.nodes(data=True))
    plan, optimized, model = check_hard_model(
        AutocastInside, args, covers=lambda a: True, check_memory=False
    )
    with preserved_state(model):
        measured = measure_step(optimized, args, {}).peak_bytes
    assert plan.static.resident_bytes + measured <= plan.budget.total_bytes
    assert measured <= plan.profile.peak_bytes * 1.03


class AllAutocast(nn.Module):
    """Every layer inside one autocast block."""

    def __init__(self, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for layer in self.layers:
                x = torch.tanh(layer(x))
        return x.float().sum()


def test_tracer_warns_about_autocast_blocks_and_the_weight_cache() -> None:
    with _warnings() as seen:
        chkpt_opt.trace(AllAutocast(), (torch.randn(8, 64),))
        with _bf16(cache=True)():
            chkpt_opt.trace(LayerNormMlp(), (torch.randn(8, 64),))
        with _bf16(cache=False)():
            chkpt_opt.trace(LayerNormMlp(), (torch.randn(8, 64),))
    assert sum("autocast block(s) inside forward" in m for m in seen) == 1
    assert sum("weight cache on" in m for m in seen) == 1


@contextlib.contextmanager
def _warnings() -> Iterator[list[str]]:
    """Warnings logged by chkpt_opt (pytest's logging plugin may be off)."""
    import logging

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logger = logging.getLogger("chkpt_opt")
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)


@pytest.mark.xfail(
    strict=True,
    reason="known gap: an autocast block inside forward is one opaque op in the cost graph; "
    "its backward is modelled as one step holding all its saved tensors and gradients, so "
    "the prediction is conservative by more than 3%, and nothing inside it is recomputed",
)
def test_autocast_inside_forward_prediction_within_3_percent() -> None:
    torch.manual_seed(0)
    model = AllAutocast()
    args = (torch.randn(512, 64),)
    plan = chkpt_opt.plan(model, args, budget=10**15, optimizer=None, profile_times=False)
    with preserved_state(model):
        measured = measure_step(plan.apply(), args, {}).peak_bytes
    assert abs(measured - plan.profile.peak_bytes) <= 0.03 * measured


class LayerNormMlp(nn.Module):
    def __init__(self, width: int = 64, depth: int = 5) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(self.norm(layer(x)))
        return x.float().pow(2).mean()


def _bf16(cache: bool = False) -> Context:
    return lambda: torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache)


def test_model_planned_and_trained_under_autocast() -> None:
    """Planned under autocast, the graph holds bfloat16 activations; trained under the same
    autocast, the optimized module matches the model bit for bit and the plan's peak."""
    plan, _, _ = check_hard_model(
        LayerNormMlp,
        (torch.randn(512, 64),),
        covers=op_is("aten.linear"),
        context=_bf16(),
    )
    linear = next(
        n for n in ordered_nodes(plan.graph) if plan.graph.nodes[n]["op"] == "aten.linear.default"
    )
    assert plan.graph.nodes[linear]["output_bytes"] == 512 * 64 * 2  # bfloat16


@pytest.mark.xfail(
    strict=True,
    reason="known gap: autocast's weight cache (cache_enabled=True, the default) keeps the "
    "bfloat16 copies of the parameters until autocast exits; the cost graph does not see "
    "them, so the measured peak exceeds the plan (the tracer warns about it)",
)
def test_autocast_weight_cache_is_in_the_plan() -> None:
    torch.manual_seed(0)
    model = LayerNormMlp(width=256)
    args = (torch.randn(64, 256),)
    with _bf16(cache=True)():
        plan = chkpt_opt.plan(model, args, budget=10**15, optimizer=None, profile_times=False)
        with preserved_state(model):
            measured = measure_step(plan.apply(), args, {}).peak_bytes
    assert abs(measured - plan.profile.peak_bytes) <= 0.03 * measured


# ---- several outputs ----------------------------------------------------------------------


class ManyOutputs(nn.Module):
    """Returns a tuple of a nested dict (activations, a scalar, an integer tensor) and a
    tensor."""

    def __init__(self, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
        hidden = {}
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i % 2:
                hidden[f"h{i}"] = x
        return {"hidden": hidden, "last": x.pow(2).mean(), "argmax": x.argmax(-1)}, x * 2


def test_several_outputs_and_dict_outputs() -> None:
    # The peak is checked in test_output_that_is_also_read_twice_is_planned (a known gap).
    _plan, optimized, model = check_hard_model(
        ManyOutputs, (torch.randn(512, 64),), covers=op_is("aten.linear"), check_memory=False
    )
    x = torch.randn(512, 64)
    with torch.no_grad():
        (a, b), (c, d) = optimized(x), model(x)
    assert set(a) == set(c) and set(a["hidden"]) == set(c["hidden"]) == {"h1", "h3", "h5"}
    assert torch.equal(a["argmax"], c["argmax"]) and torch.equal(b, d)


class OutputReadTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = torch.tanh(self.layer(x))
        return h, h.pow(2).mean(), h * 2


def test_output_that_is_also_read_twice_is_planned() -> None:
    model = OutputReadTwice()
    args = (torch.randn(512, 64),)
    plan = chkpt_opt.plan(
        model, args, budget=10**15, optimizer=None, profile_times=False
    )  # keep everything
    with preserved_state(model):
        measured = measure_step(plan.apply(), args, {}).peak_bytes
    assert measured <= plan.profile.peak_bytes


# ---- mixture of experts -------------------------------------------------------------------


class MoE(nn.Module):
    """Noisy top-k routing with capacity, dispatched by index: scatter-add into per-expert
    slots, batched expert matmuls, gather back."""

    def __init__(self, width: int = 32, experts: int = 4, k: int = 2, capacity: int = 48) -> None:
        super().__init__()
        self.experts, self.k, self.capacity = experts, k, capacity
        self.router = nn.Linear(width, experts)
        self.w1 = nn.Parameter(torch.randn(experts, width, 2 * width) * width**-0.5)
        self.w2 = nn.Parameter(torch.randn(experts, 2 * width, width) * (2 * width) ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, width = x.shape
        e, k, c = self.experts, self.k, self.capacity
        logits = self.router(x) + torch.randn_like(x[:, :e])  # noise decides close calls
        top_value, top_index = logits.topk(k, dim=-1)
        gates = torch.softmax(top_value, dim=-1)
        chosen = F.one_hot(top_index, e).sum(1)
        position = torch.cumsum(chosen, 0) - 1
        keep = (chosen > 0) & (position < c)
        slot = torch.where(keep, torch.arange(e)[None] * c + position, e * c)
        slots = slot.gather(1, top_index).flatten()  # overflow goes to a dump slot
        buf = x.new_zeros(e * c + 1, width).index_add(0, slots, x.repeat_interleave(k, 0))
        h = torch.relu(torch.bmm(buf[: e * c].view(e, c, width), self.w1))
        out = torch.bmm(h, self.w2).reshape(e * c, width)
        out = torch.cat([out, out.new_zeros(1, width)])
        y = out.index_select(0, slots).view(tokens, k, width)
        return (y * gates.unsqueeze(-1)).sum(1)


class Switch(nn.Module):
    """Top-1 routing by argmax over noisy logits, dense dispatch with masks."""

    def __init__(self, width: int = 32, experts: int = 3) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x) + torch.randn_like(x[:, :1])
        choice = logits.argmax(-1)
        weight = torch.softmax(logits, -1).gather(1, choice[:, None])
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            y = y + torch.where((choice == e)[:, None], expert(x), 0.0)
        return y * weight


class MoeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 32)
        self.moe = nn.ModuleList([MoE(), MoE()])
        self.switch = Switch()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for moe in self.moe:
            x = x + moe(x)
        x = x + self.switch(x)
        return x.pow(2).mean()


class _Routing(TorchDispatchMode):
    """Records every routing decision (topk and argmax indices), forward or recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.decisions: list[tuple[bool, torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.topk.default, torch.ops.aten.argmax.default):
            index = out[1] if isinstance(out, tuple) else out
            self.decisions.append((is_recomputing(), index.clone()))
        return out


def test_mixture_of_experts_routing_does_not_change_on_recompute() -> None:
    """Under the plan at the smallest budget and under the whole-forward schedule (which
    recomputes every router: the plan's may cache a router, or stop its recomputation
    before one), every routing decision made while recomputing is one the forward made."""
    args = (torch.randn(96, 32),)
    plan, optimized, model = check_hard_model(
        MoeNet, args, covers=op_is("aten.topk", "aten.argmax")
    )
    forced = rewrite_module(
        plan.traced.captured.fresh_module(), plan.graph, whole_forward(plan.graph)
    )
    for module, must_recompute in ((optimized, False), (forced, True)):
        with preserved_state(model), _Routing() as routing:
            torch.manual_seed(7)
            loss_of(module(*args)).backward()
        forward = [index for again, index in routing.decisions if not again]
        recomputed = [index for again, index in routing.decisions if again]
        assert len(forward) == 3  # two top-2 routers and one argmax router
        assert recomputed or not must_recompute, "the whole forward recomputes the routers"
        for index in recomputed:
            assert any(index.shape == f.shape and torch.equal(index, f) for f in forward)


# ---- torch.compile ------------------------------------------------------------------------


class CompileNet(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(4))
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 1:
                x = self.norm(x)
            x = F.dropout(x, 0.2)
        return x.pow(2).mean()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_of_the_optimized_module_trains_like_eager(backend: str) -> None:
    """Before the fix, compiling failed: dynamo refuses checkpoint's context_fn unless it
    makes dispatch modes. aot_eager runs the same kernels (bitwise); inductor fuses them
    (float rounding) and, to draw eager's random numbers, needs fallback_random."""
    import torch._dynamo
    import torch._inductor.config

    with torch._inductor.config.patch(fallback_random=True):
        _compile_and_train(backend)


def _compile_and_train(backend: str) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    initial = CompileNet()
    reference, model = copy.deepcopy(initial), copy.deepcopy(initial)
    args = (torch.randn(256, 32),)
    full = chkpt_opt.plan(model, args, budget=10**15, optimizer=None, profile_times=False)
    # the smallest budget of the plans the compiled step runs (one level of regions)
    lowest = smallest_peak(full.graph, time_limit_s=LIMIT_S, nesting=False).peak_bytes
    plan = chkpt_opt.plan(
        model, args, budget=full.static.resident_bytes + lowest, optimizer=None, profile_times=False
    ).for_compile()  # what the compiled step runs (a staged plan runs eagerly only)
    assert plan.schedule.regions
    compiled = torch.compile(plan.apply(), backend=backend)
    train(reference, reference, args, {}, context=contextlib.nullcontext, reseed=None)
    train(compiled, model, args, {}, context=contextlib.nullcontext, reseed=None)
    assert_same_state(reference, model, rtol=None if backend == "aot_eager" else 1e-5)
    explained = torch._dynamo.explain(plan.apply())(*args)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()


# ---- what cannot be handled: clear errors -------------------------------------------------


class NonZero(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layer(x)
        return h[torch.nonzero(h[:, 0] > 0).squeeze(1)].sum()


@pytest.mark.parametrize("tracer", ["auto", "fx"])
def test_data_dependent_shapes_are_refused_naming_the_op(tracer: str) -> None:
    with pytest.raises(TraceError) as info:
        chkpt_opt.plan(
            NonZero(), (torch.randn(8, 16),), budget=10**15, tracer=tracer, profile_times=False
        )
    message = str(info.value)
    assert "nonzero" in message and "output shape depends on tensor values" in message


def test_python_value_of_a_tensor_is_refused_naming_the_op() -> None:
    """Batch norm with momentum=None divides by float(num_batches_tracked)."""
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16, momentum=None))
    with pytest.raises(TraceError) as info:
        chkpt_opt.plan(model, (torch.randn(8, 16),), budget=10**15, profile_times=False)
    message = str(info.value)
    assert "BatchNorm1d" in message and "reads a tensor's value into Python" in message


@torch.library.custom_op("chkpt_opt_tests::opaque_sin", mutates_args=())
def _opaque_sin(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


class Opaque(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _opaque_sin(self.layer(x)).sum()


def test_op_without_fake_kernel_is_refused_naming_the_op() -> None:
    with pytest.raises(TraceError) as info:
        chkpt_opt.plan(Opaque(), (torch.randn(8, 16),), budget=10**15, profile_times=False)
    message = str(info.value)
    assert "opaque_sin" in message and "no fake-tensor (meta) kernel" in message


class NoGradInside(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.layers[0](x))
        with torch.no_grad():
            scale = x.abs().mean(0, keepdim=True) + 1
        x = x / scale
        for layer in self.layers[1:]:
            x = torch.tanh(layer(x))
        return x.sum()


def test_fx_tracer_refuses_no_grad_and_autocast_blocks() -> None:
    """Before the fix, tracer='fx' dropped them silently: gradients flowed through the
    no-grad block, and the autocast block computed in float32."""
    with pytest.raises(TraceError, match="grad mode disabled inside forward"):
        chkpt_opt.plan(
            NoGradInside(), (torch.randn(8, 32),), budget=10**15, tracer="fx", profile_times=False
        )
    with pytest.raises(TraceError, match="autocast enabled inside forward"):
        chkpt_opt.plan(
            AutocastInside(), (torch.randn(8, 64),), budget=10**15, tracer="fx", profile_times=False
        )


def test_region_boundary_inside_a_no_grad_span_is_refused() -> None:
    model = NoGradInside()
    plan = chkpt_opt.plan(
        model, (torch.randn(64, 32),), budget=10**15, optimizer=None, profile_times=False
    )
    graph = plan.graph
    order = ordered_nodes(graph)
    span = next(n for n in order if "wrap_with_set_grad_enabled" in graph.nodes[n]["op"])
    assert not graph.nodes[span]["cut_after_ok"]
    i = graph.nodes[span]["index"]
    with pytest.raises(ScheduleError, match="cannot be split"):
        rewrite_module(
            plan.traced.captured.fresh_module(), graph, Schedule(regions=(tuple(order[: i + 1]),))
        )
    # The whole span inside a region is fine, and trains like the model.
    torch.manual_seed(0)
    whole = rewrite_module(plan.traced.captured.fresh_module(), graph, whole_forward(graph))
    x = torch.randn(64, 32)
    loss_of(whole(x)).backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    loss_of(model(x)).backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(got, model.parameters()))


def test_schedule_for_another_model_is_refused() -> None:
    plan = chkpt_opt.plan(
        NoGradInside(), (torch.randn(8, 32),), budget=10**15, optimizer=None, profile_times=False
    )
    with pytest.raises(ChkptOptError, match="not in graph"):
        rewrite_module(
            plan.traced.captured.fresh_module(), plan.graph, Schedule(regions=(("no_such_op",),))
        )
