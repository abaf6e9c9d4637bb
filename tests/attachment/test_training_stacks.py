"""The budget holds on every step of the loops people run (chkpt_opt.attachment.step_state):
gradient accumulation over two micro-batches (``zero_grad`` to None, and to zeros), bf16
autocast with its default weight cache, and Hugging Face ``Trainer`` with both; on a GPT in
nanoGPT's style and on a Llama. The budget of each is the measured peak of the same stack
with every block under per-block ``torch.utils.checkpoint``; every step of the attached
plan measures at most that, and trains bitwise like the original."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import chkpt_opt
from chkpt_opt.attachment.step_state import shared_gradient_bytes
from chkpt_opt.codegen import rewrite_module
from chkpt_opt.graphs.tracer import trace_model
from chkpt_opt.graphs.tracer.storage import StorageTracker
from chkpt_opt.measurement.step import measure_step
from chkpt_opt.memory_model.schedule import Schedule
from chkpt_opt.memory_model.sequence.gradients import holding_parameter_gradients
from chkpt_opt.memory_model.simulate import simulate
from chkpt_opt.solvers import get_solver
from chkpt_opt.step_budget.whole_step import static_memory_for
from tests.attachment.tiny_models import tiny_llama

transformers = pytest.importorskip("transformers")

GPT_VOCAB, LLAMA_VOCAB = 512, 256
STEPS = 3


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = _Attention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.c_fc = nn.Linear(width, 4 * width)
        self.c_proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    """nanoGPT's layout (pre-norm blocks, tied embedding and head), 4 layers of width 128;
    ``checkpoint_blocks``: each block under ``torch.utils.checkpoint``, as nanoGPT's forks
    do it. Returns its loss in a mapping, as ``Trainer`` reads it."""

    def __init__(self, layers: int = 4, width: int = 128, context: int = 128) -> None:
        super().__init__()
        self.wte = nn.Embedding(GPT_VOCAB, width)
        self.wpe = nn.Embedding(context, width)
        self.h = nn.ModuleList(_Block(width, 4) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, GPT_VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight
        self.checkpoint_blocks = False

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.h:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpoint_blocks else block(x)
        logits = self.lm_head(self.ln_f(x))
        return {"loss": F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))}


@dataclass(frozen=True)
class _Model:
    build: Callable[[], nn.Module]
    vocab: int
    shape: tuple[int, int]
    checkpointed: Callable[[nn.Module], None]  # per-block torch.utils.checkpoint, in place


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT().train()


def _gpt_blocks(model: nn.Module) -> None:
    model.checkpoint_blocks = True


def _llama() -> nn.Module:
    return tiny_llama(vocab=LLAMA_VOCAB, layers=4, max_positions=128)


def _llama_blocks(model: nn.Module) -> None:
    model.gradient_checkpointing_enable({"use_reentrant": False})


MODELS = {
    "gpt": _Model(_gpt, GPT_VOCAB, (8, 128), _gpt_blocks),
    "llama": _Model(_llama, LLAMA_VOCAB, (8, 64), _llama_blocks),
}


@dataclass(frozen=True)
class _Stack:
    micro_batches: int = 1
    set_to_none: bool = True
    autocast: bool = False
    prefetch: bool = False  # the next batch fetched between forward and backward (nanoGPT)


STACKS = {
    "eager": _Stack(),
    "accumulate": _Stack(micro_batches=2),
    "accumulate_zeroed": _Stack(micro_batches=2, set_to_none=False),
    "bf16_autocast": _Stack(autocast=True),
    "prefetch": _Stack(micro_batches=2, prefetch=True),
}


def _batches(spec: _Model, count: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        {
            "input_ids": torch.randint(0, spec.vocab, spec.shape, generator=gen),
            "labels": torch.randint(0, spec.vocab, spec.shape, generator=gen),
        }
        for _ in range(count)
    ]


def _bytes_alive(tensors: list[Any]) -> int:
    """Bytes of the distinct storages of ``tensors`` (None skipped)."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in tensors
        if isinstance(t, torch.Tensor)
    }
    return sum(storages.values())


def _state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Any]:
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values()]
    return [*params, *model.buffers(), *(p.grad for p in params), *state]


def _train(model: nn.Module, spec: _Model, stack: _Stack) -> tuple[list[int], list[float], Any]:
    """The loop of ``stack``: per optimizer step, the peak of live bytes on the device
    (what was alive at its start, counted exactly, plus the peak of storages created
    during it, each micro-batch's inputs from its forward to its backward), the
    micro-batches' losses, and the gradients at the end."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = _batches(spec, STEPS * stack.micro_batches)
    peaks: list[int] = []
    losses: list[float] = []

    def fetched(i: int) -> dict[str, torch.Tensor] | None:  # on the device from here
        return {k: v.clone() for k, v in data[i].items()} if i < len(data) else None

    batch = fetched(0) if stack.prefetch else None  # fetched before the loop, as nanoGPT
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=stack.set_to_none)
        first = step * stack.micro_batches
        alive = _bytes_alive([*_state_tensors(model, optimizer), *(batch or {}).values()])
        with StorageTracker() as tracker:
            for i in range(first, first + stack.micro_batches):
                if not stack.prefetch:  # on the device while its micro-batch runs
                    batch = fetched(i)
                assert batch is not None
                if stack.autocast:  # the default weight cache; backward outside, as nanoGPT
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = model(**batch)["loss"]
                else:
                    loss = model(**batch)["loss"]
                if stack.prefetch:
                    batch = fetched(i + 1)
                (loss / stack.micro_batches).backward()
                losses.append(loss.item())
                del loss
                if not stack.prefetch:
                    batch = None
            optimizer.step()
        peaks.append(alive + tracker.peak_bytes)
    return peaks, losses, [p.grad for p in model.parameters()]


def _equal(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b)
    )


def _attached(original: nn.Module, budget: int) -> nn.Module:
    # The loops drop the Llama's logits before the backward pass (``["loss"]``, Trainer).
    return chkpt_opt.optimize(
        copy.deepcopy(original),
        budget=budget,
        time_limit_s=3,
        profile_times=False,
        outputs_held=False,
    )


# One stack per model runs by default (a minute or two each on 2 cores); all of them with
# -m slow.
_DEFAULT = {
    ("gpt", "accumulate"),
    ("gpt", "bf16_autocast"),
    ("gpt", "prefetch"),
    ("llama", "accumulate_zeroed"),
}
CASES = [
    pytest.param(m, s, id=f"{m}-{s}", marks=() if (m, s) in _DEFAULT else pytest.mark.slow)
    for m in MODELS
    for s in STACKS
]


@pytest.mark.parametrize(("model_name", "stack_name"), CASES)
def test_every_step_of_the_loop_fits_the_budget_of_per_block_checkpointing(
    model_name: str, stack_name: str
) -> None:
    spec, stack = MODELS[model_name], STACKS[stack_name]
    original = spec.build()
    per_block = copy.deepcopy(original)
    spec.checkpointed(per_block)
    block_peaks, _, _ = _train(per_block, spec, stack)
    budget = max(block_peaks)
    expected_peaks, expected_losses, expected_grads = _train(copy.deepcopy(original), spec, stack)
    model = _attached(original, budget)
    peaks, losses, grads = _train(model, spec, stack)
    assert max(peaks) <= budget < max(expected_peaks), (peaks, budget)
    assert losses == expected_losses
    assert _equal(grads, expected_grads)
    attachment = chkpt_opt.attachment_of(model)
    # A loop that accumulates is planned for its calls with the gradients alive (every call
    # after the first where they are zeroed, not freed); one that does not never is.
    accumulates = stack.micro_batches > 1 or not stack.set_to_none
    held = {r.key.grads_held for r in attachment.runners}
    assert held == ({False, True} if accumulates else {False})
    # The next batch, fetched between the forward and the backward pass, is seen there
    # (.fetched_batches) and counted by the plans made after.
    assert attachment.fetched_share == (1.0 if stack.prefetch else 0.0)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, spec: _Model, count: int) -> None:
        self.items = _batches(spec, count)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {name: value[0] for name, value in self.items[i].items()}


class _StepPeaks(transformers.TrainerCallback):  # type: ignore[misc]
    """Each optimizer step's peak of live bytes: those alive before training (parameters,
    buffers) plus the peak of storages created since, restarted at each step."""

    def __init__(self, tracker: StorageTracker, alive_bytes: int) -> None:
        self.tracker, self.alive_bytes = tracker, alive_bytes
        self.peaks: list[int] = []

    def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
        self.tracker.reset_peak()

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self.peaks.append(self.alive_bytes + self.tracker.peak_bytes)


def _trainer_run(
    model: nn.Module, spec: _Model, folder: Path, **args: Any
) -> tuple[list[int], list[float]]:
    arguments = transformers.TrainingArguments(
        str(folder),
        per_device_train_batch_size=spec.shape[0] // 2,
        gradient_accumulation_steps=2,
        bf16=True,
        max_steps=STEPS,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        **args,
    )
    trainer = transformers.Trainer(
        model=model, args=arguments, train_dataset=_Tokens(spec, STEPS * spec.shape[0])
    )
    alive = _bytes_alive([*model.parameters(), *model.buffers()])
    with StorageTracker() as tracker:
        callback = _StepPeaks(tracker, alive)
        trainer.add_callback(callback)
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return callback.peaks, losses


@pytest.mark.parametrize(
    "model_name", [pytest.param("gpt", marks=pytest.mark.slow), pytest.param("llama")]
)
def test_trainer_with_accumulation_and_bf16_fits_the_budget_of_per_block_checkpointing(
    model_name: str, tmp_path: Path
) -> None:
    pytest.importorskip("accelerate")
    spec = MODELS[model_name]
    original = spec.build()
    per_block = copy.deepcopy(original)
    spec.checkpointed(per_block)
    block_peaks, _ = _trainer_run(per_block, spec, tmp_path / "per_block")
    budget = max(block_peaks)
    expected_peaks, expected_losses = _trainer_run(original, spec, tmp_path / "original")
    # Trainer holds the step's other micro-batch (fetched before the first runs) and the
    # copy it feeds: the plans count them (chkpt_opt.attachment.held_batches).
    model = _attached(spec.build(), budget)
    peaks, losses = _trainer_run(model, spec, tmp_path / "attached")
    assert len(peaks) == STEPS and max(peaks) <= budget < max(expected_peaks), (peaks, budget)
    assert losses == expected_losses
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), original.parameters()))
    assert {r.key.grads_held for r in chkpt_opt.attachment_of(model).runners} == {True, False}


def test_a_step_with_the_gradients_held_measures_what_its_op_sequence_says() -> None:
    # Parameters large against activations: without gradients held the step peaks with all
    # of them created; with them held (resident), at one transient gradient at a time.
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.Tanh())])
    inputs = (torch.randn(4, 256),)
    traced = trace_model(model.train(), inputs)
    graph = traced.graph
    held = holding_parameter_gradients(graph)
    for schedule in (Schedule(), get_solver("sqrt")(graph, 10**12).schedule):
        module = rewrite_module(traced.captured.fresh_module(), graph, schedule)
        model.zero_grad(set_to_none=True)
        fresh = measure_step(module, inputs).peak_bytes
        assert fresh == simulate(graph, schedule).peak_bytes
        summed = measure_step(module, inputs).peak_bytes  # the gradients of the first held
        assert summed == simulate(held, schedule).peak_bytes < fresh
    grad_bytes = graph.graph["trainable_param_bytes"]
    plain, accumulating = static_memory_for(graph), static_memory_for(held)
    assert accumulating.resident_bytes - plain.resident_bytes == grad_bytes
    assert plain.optimizer_phase_bytes - accumulating.optimizer_phase_bytes == grad_bytes


def test_a_tied_embedding_keeps_its_first_gradient_until_the_embedding_backward() -> None:
    # lm_head and wte share one weight: autograd sums the head's gradient with the
    # embedding's in the input buffer of its AccumulateGrad, so with the gradients held
    # the head's stays alive until the end of the backward pass, as without.
    torch.manual_seed(0)
    model = GPT(layers=2, width=64, context=32).train()
    batch = {name: torch.randint(0, GPT_VOCAB, (2, 32)) for name in ("input_ids", "labels")}
    traced = trace_model(model, (), batch)
    graph = traced.graph
    shared = shared_gradient_bytes(traced.captured.module, graph)
    head = max((n for n in graph if graph.nodes[n]["param_grad_bytes"]), key=graph_index(graph))
    assert shared == {head: GPT_VOCAB * 64 * 4}
    held = holding_parameter_gradients(graph, shared)
    assert held.nodes[head]["param_grad_bytes"] == shared[head]
    for schedule in (Schedule(), get_solver("sqrt")(graph, 10**12).schedule):
        module = rewrite_module(traced.captured.fresh_module(), graph, schedule)
        model.zero_grad(set_to_none=True)
        measure_step(module, (), batch)
        assert measure_step(module, (), batch).peak_bytes == simulate(held, schedule).peak_bytes


def graph_index(graph: Any) -> Callable[[str], int]:
    return lambda n: graph.nodes[n]["index"]
