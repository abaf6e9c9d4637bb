"""Fine-tuning as people run it: the original model, HF's checkpointing and chkpt_opt, side by side.

Run:
    python benchmarks/finetune.py                          # Llama, BERT, T5 at the defaults
    python benchmarks/finetune.py --families llama --steps 12 --max-len 128

Models, built from configs with random weights (nothing is downloaded), ``--layers`` layers of
width ``--width``, vocabulary 2048, every other setting as the config ships:

* ``llama``: ``LlamaForCausalLM`` (RoPE, grouped-query attention: width / 64 heads, half as
  many key/value heads; ``use_cache=True`` as shipped); labels are the input ids, -100 on
  padding;
* ``bert``: ``BertForMaskedLM``; 15% of the real tokens are replaced by a mask id and are the
  only labelled positions (-100 elsewhere, padding included); dropout 0.1 as shipped;
* ``t5``: ``T5ForConditionalGeneration``, ``--layers`` layers in the encoder and as many in
  the decoder; targets of lengths of their own (labels -100 on their padding); dropout 0.1.

Data: ``--steps`` batches of ``--batch`` sequences whose lengths are drawn log-uniformly between
32 and ``--max-len`` (T5 targets: between 16 and ``--max-len`` / 2), padded on the right to
the longest of the batch, ``attention_mask`` 0 on the padding. Fixed seeds: every contender
sees the same batches, and the global random stream is re-seeded before each contender's
step, so dropout draws the same masks for all.

Contenders, each a deep copy of one model with its own ``torch.optim.AdamW``; every step is
``optimizer.zero_grad(); model(**batch).loss.backward(); optimizer.step()``:

1. ``original``: no checkpointing;
2. ``hf_checkpointing``: ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=
   {"use_reentrant": False})``;
3. ``chkpt_opt``: ``chkpt_opt.optimize(copy, budget=B, time_limit_s=--time-limit)``, planned
   by the library itself on the first training batch and on every larger shape it meets.
   Where it raises ``InfeasibleBudgetError`` (no schedule fits ``B`` as it predicts), the
   error is reported and the other two go on.

The budget ``B`` is the highest measured whole-step peak of ``hf_checkpointing`` over all the
batches, measured in a first pass before any training.

Memory. Each step's forward/backward peak is measured exactly by
:class:`~chkpt_opt.graphs.tracer.storage.StorageTracker` (every tensor storage created while
``model(**batch).loss.backward()`` runs, parameter gradients included) in a pass of its own
right after the timed step (the tracker is a Python dispatch mode: it would slow the timed
step; the weights have moved by one step by then, which changes no tensor's size). The
whole-step peak adds, for every contender alike, the resident memory counted by chkpt_opt's
own formula (:func:`chkpt_opt.step_budget.budget.static_memory`: parameters, buffers, the batch,
AdamW's two fp32 states and step counters) and takes the optimizer phase into account
(:meth:`~chkpt_opt.step_budget.budget.StaticMemory.step_peak_bytes`). For chkpt_opt the resident
bytes its runners report are checked against that formula.

Time. torch runs on ``--threads`` threads (default 1: on this shared 2-core machine, 2
threads ran a Llama step 7x slower than 1). The contenders run round-robin, one step each
per batch, starting from another contender at each batch, so machine noise hits them alike.
Throughput is tokens/s of the whole step (real tokens, and padded tokens); ratios to the
original and to ``hf_checkpointing`` are the median of the per-step ratios, ± twice their
median absolute deviation (``peers.paired_ratio``). Steps where chkpt_opt captured a new
input signature (planning included) are excluded from the ratios (their count is reported)
but not from the peak check. For chkpt_opt: the first step's ``prepare_s`` (capture, solve,
rewrite), the total over the run, the share of it spent on later shapes,
captures/solves/reuses. The losses of the three contenders at the first step (same weights,
same batch, same seed) are compared.

Writes finetune.csv and finetune.md to ``--out`` (default benchmarks/results/finetune).
"""

from __future__ import annotations

import argparse
import copy
import csv
import logging
import math
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peers import paired_ratio
from torch import nn

import chkpt_opt
from chkpt_opt.attachment import Runner
from chkpt_opt.errors import InfeasibleBudgetError
from chkpt_opt.graphs.tracer.storage import StorageTracker
from chkpt_opt.step_budget.budget import StaticMemory, optimizer_spec, static_memory

FAMILIES = ("llama", "bert", "t5")
CONTENDERS = ("original", "hf_checkpointing", "chkpt_opt")
VOCAB = 2048
PAD_ID = 0
MASK_ID = 3
MIN_LEN = 32
MIN_TARGET_LEN = 16
MIB = 2**20
LR = 1e-4
OUT = Path(__file__).resolve().parent / "results" / "finetune"
FIELDS = [
    "family",
    "contender",
    "params_m",
    "budget_mib",
    "peak_mib",
    "peak_step",
    "steps_over_budget",
    "fwd_bwd_peak_mib",
    "predicted_peak_mib",
    "resident_mib",
    "resident_matches_formula",
    "steps",
    "steps_excluded",
    "tokens_per_s",
    "padded_tokens_per_s",
    "vs_original",
    "vs_original_spread",
    "vs_hf",
    "vs_hf_spread",
    "first_loss",
    "first_loss_diff",
    "last_loss",
    "first_prepare_s",
    "total_prepare_s",
    "later_prepare_share",
    "solve_s",
    "captures",
    "solves",
    "reuses",
    "schedules",
    "predicted_over_measured_mib",
    "error",
]


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# -- models -------------------------------------------------------------------------------


def build(family: str, *, layers: int, width: int, max_len: int, seed: int = 0) -> nn.Module:
    """The family's model from its shipped config with these sizes, random weights, in train
    mode."""
    import transformers

    heads = max(1, width // 64)
    if family == "llama":
        config: Any = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=width,
            intermediate_size=4 * width,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2),
        )
        make: Callable[[], nn.Module] = lambda: transformers.LlamaForCausalLM(config)  # noqa: E731
    elif family == "bert":
        config = transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=width,
            intermediate_size=4 * width,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            max_position_embeddings=max(512, max_len),
        )
        make = lambda: transformers.BertForMaskedLM(config)  # noqa: E731
    elif family == "t5":
        config = transformers.T5Config(
            vocab_size=VOCAB,
            d_model=width,
            d_kv=width // heads,
            d_ff=4 * width,
            num_layers=layers,
            num_decoder_layers=layers,
            num_heads=heads,
            decoder_start_token_id=PAD_ID,
        )
        make = lambda: transformers.T5ForConditionalGeneration(config)  # noqa: E731
    else:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    torch.manual_seed(seed)
    return make().train()


# -- data ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """One step's keyword inputs and its token counts (real and padded)."""

    inputs: dict[str, torch.Tensor]
    tokens: int
    padded_tokens: int

    def describe(self) -> str:
        return ", ".join(f"{k} {tuple(v.shape)}" for k, v in self.inputs.items())


def _lengths(gen: torch.Generator, n: int, low: int, high: int) -> list[int]:
    """``n`` lengths drawn log-uniformly between ``low`` and ``high`` (inclusive)."""
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    values = torch.exp(math.log(low) + u * (math.log(high + 1) - math.log(low)))
    return [min(high, int(v)) for v in values]


def _padded(gen: torch.Generator, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids (never the pad id) padded on the right to the longest, and their mask."""
    longest = max(lengths)
    ids = torch.randint(MASK_ID + 1, VOCAB, (len(lengths), longest), generator=gen)
    mask = torch.zeros(len(lengths), longest, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    return ids.masked_fill(mask == 0, PAD_ID), mask


def make_batch(family: str, gen: torch.Generator, batch: int, max_len: int) -> Batch:
    """One batch of the family's task (see the module docstring)."""
    lengths = _lengths(gen, batch, MIN_LEN, max_len)
    ids, mask = _padded(gen, lengths)
    tokens, padded = int(mask.sum()), mask.numel()
    if family == "llama":
        labels = ids.masked_fill(mask == 0, -100)
    elif family == "bert":
        chosen = (torch.rand(ids.shape, generator=gen) < 0.15) & (mask == 1)
        labels = ids.masked_fill(~chosen, -100)
        ids = ids.masked_fill(chosen, MASK_ID)
    elif family == "t5":
        targets = _lengths(gen, batch, MIN_TARGET_LEN, max(MIN_TARGET_LEN, max_len // 2))
        target_ids, target_mask = _padded(gen, targets)
        labels = target_ids.masked_fill(target_mask == 0, -100)
        tokens += int(target_mask.sum())
        padded += target_mask.numel()
    else:
        raise ValueError(family)
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return Batch(inputs, tokens, padded)


def make_batches(family: str, *, steps: int, batch: int, max_len: int, seed: int) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    return [make_batch(family, gen, batch, max_len) for _ in range(steps)]


# -- memory -------------------------------------------------------------------------------


def resident_of(model: nn.Module, batch: Batch) -> StaticMemory:
    """The step's resident memory by chkpt_opt's formula, AdamW on this CPU (PyTorch runs it
    per tensor here, not ``foreach``)."""
    params = list(model.parameters())
    trainable = [p.numel() * p.element_size() for p in params if p.requires_grad]
    return static_memory(
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        trainable_param_bytes=sum(trainable),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        input_bytes=sum(t.numel() * t.element_size() for t in batch.inputs.values()),
        n_trainable_tensors=len(trainable),
        largest_param_bytes=max(trainable, default=0) or None,
        optimizer=optimizer_spec("adamw"),
        foreach=False,
    )


def fwd_bwd_peak(model: nn.Module, batch: Batch, seed: int) -> int:
    """The exact peak of tensor storages created by ``model(**batch).loss.backward()``
    (gradients unset before and after: the step's own)."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    with StorageTracker() as tracker:
        model(**batch.inputs).loss.backward()
    for p in model.parameters():
        p.grad = None
    return tracker.peak_bytes


# -- the run ------------------------------------------------------------------------------


@dataclass
class Contender:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)  # whole step
    fwd_bwd: list[int] = field(default_factory=list)


def train_step(contender: Contender, batch: Batch, seed: int) -> None:
    """One timed training step: zero grads, forward, backward, optimizer step."""
    model, optimizer = contender.model, contender.optimizer
    torch.manual_seed(seed)
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = model(**batch.inputs).loss
    loss.backward()
    optimizer.step()
    contender.times.append(time.perf_counter() - start)
    contender.losses.append(float(loss.detach()))


def contenders_of(model: nn.Module, budget: int, time_limit_s: float) -> list[Contender]:
    def made(name: str, module: nn.Module) -> Contender:
        return Contender(name, module, torch.optim.AdamW(module.parameters(), lr=LR))

    hf = copy.deepcopy(model)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ours = chkpt_opt.optimize(copy.deepcopy(model), budget=budget, time_limit_s=time_limit_s)
    return [
        made("original", copy.deepcopy(model)),
        made("hf_checkpointing", hf),
        made("chkpt_opt", ours),
    ]


def run_family(family: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    started = time.perf_counter()
    model = build(family, layers=args.layers, width=args.width, max_len=args.max_len)
    batches = make_batches(
        family, steps=args.steps, batch=args.batch, max_len=args.max_len, seed=args.seed
    )
    seeds = [args.seed * 1000 + i for i in range(len(batches))]
    residents = [resident_of(model, b) for b in batches]
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"{family}: {n_params / 1e6:.2f} M parameters, attention "
        f"{model.config._attn_implementation}, {len(batches)} batches "
        f"({min(b.inputs['input_ids'].shape[1] for b in batches)}.."
        f"{max(b.inputs['input_ids'].shape[1] for b in batches)} padded tokens per sequence)"
    )

    # First pass: HF's checkpointing over every batch, to set the budget.
    probe = copy.deepcopy(model)
    probe.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_peaks = [
        static.step_peak_bytes(fwd_bwd_peak(probe, batch, seed))
        for static, batch, seed in zip(residents, batches, seeds, strict=True)
    ]
    del probe
    budget = max(hf_peaks)
    log(
        f"{family}: budget {budget / MIB:.2f} MiB (HF checkpointing's highest whole-step peak, "
        f"resident {residents[hf_peaks.index(budget)].resident_bytes / MIB:.2f} MiB of it)"
    )

    contenders = contenders_of(model, budget, args.time_limit)
    ours = contenders[-1]
    attachment = chkpt_opt.attachment_of(ours.model)
    assert attachment is not None
    captured_at: list[bool] = []
    first_prepare_s = 0.0
    resident_mismatch: list[tuple[int, int, int]] = []
    resident_checked = 0
    captured: list[tuple[int, Runner]] = []
    failure = ""
    for step, (batch, static, seed) in enumerate(zip(batches, residents, seeds, strict=True)):
        captures = attachment.stats.captures
        shift = step % len(contenders)
        for contender in contenders[shift:] + contenders[:shift]:
            try:
                train_step(contender, batch, seed)
            except InfeasibleBudgetError as err:
                if contender is not ours:
                    raise
                failure = f"step {step + 1} ({batch.describe()}): {err}"
                log(f"{family}: chkpt_opt raised at {failure}")
                continue
            peak = fwd_bwd_peak(contender.model, batch, seed)
            contender.fwd_bwd.append(peak)
            contender.peaks.append(static.step_peak_bytes(peak))
        if failure and ours in contenders:  # the others go on without it
            contenders.remove(ours)
        captured_at.append(attachment.stats.captures > captures)
        if captured_at[-1]:
            captured.append((step, attachment.runners[-1]))
        if step == 0:
            first_prepare_s = attachment.stats.prepare_s
        runner = attachment.runners[-1] if not failure else None  # the one that served
        if runner and runner.key.shapes == {k: tuple(v.shape) for k, v in batch.inputs.items()}:
            # a runner captured at these shapes (one with symbolic sizes serving a smaller
            # batch reports the resident bytes of the batch it was captured on)
            resident_checked += 1
            if runner.resident_bytes != static.resident_bytes:
                resident_mismatch.append((step + 1, runner.resident_bytes, static.resident_bytes))
        log(
            f"{family} step {step + 1}/{len(batches)} [{batch.describe()}]: "
            + ", ".join(
                f"{c.name} {c.times[-1]:.2f} s {c.peaks[-1] / MIB:.1f} MiB" for c in contenders
            )
            + (" (chkpt_opt captured)" if captured_at[-1] else "")
        )
    if resident_mismatch:
        log(
            f"{family}: chkpt_opt's resident bytes differ from the formula (step, chkpt_opt, "
            f"formula): {resident_mismatch}"
        )

    kept = [i for i, captured in enumerate(captured_at) if not captured]
    by_name = {c.name: c for c in contenders}
    resident = max(s.resident_bytes for s in residents)
    rows = [
        row_of(
            family,
            contender,
            by_name,
            batches,
            kept,
            budget=budget,
            n_params=n_params,
            resident=resident,
        )
        for contender in contenders
    ]
    if failure:
        rows.append(
            {
                "family": family,
                "contender": "chkpt_opt",
                "params_m": round(n_params / 1e6, 2),
                "budget_mib": round(budget / MIB, 2),
                "steps": len(batches),
                "steps_excluded": len(batches) - len(kept),
                "error": failure,
            }
        )
    stats = attachment.stats
    rows[-1].update(
        {
            "predicted_peak_mib": round(stats.largest_predicted_peak_bytes / MIB, 2),
            "resident_matches_formula": f"{resident_checked - len(resident_mismatch)}"
            f"/{resident_checked}",
            "first_prepare_s": round(first_prepare_s, 2),
            "total_prepare_s": round(stats.prepare_s, 2),
            "later_prepare_share": round(1 - first_prepare_s / stats.prepare_s, 3)
            if stats.prepare_s
            else 0.0,
            "solve_s": round(stats.solve_s, 2),
            "captures": stats.captures,
            "solves": stats.solves,
            "reuses": stats.reuses,
            "schedules": "; ".join(
                f"step {step + 1} {runner.key.describe()}: {runner.source}, "
                f"{len(runner.schedule.regions)} regions"
                for step, runner in captured
            ),
            "predicted_over_measured_mib": " / ".join(
                f"{(runner.predicted_peak_bytes - ours.peaks[step]) / MIB:.2f}"
                for step, runner in captured
            ),
        }
    )
    log(f"{family}: done in {time.perf_counter() - started:.0f} s")
    return rows


def row_of(
    family: str,
    contender: Contender,
    by_name: dict[str, Contender],
    batches: list[Batch],
    kept: list[int],
    *,
    budget: int,
    n_params: int,
    resident: int,
) -> dict[str, Any]:
    def throughput(c: Contender) -> list[float]:
        return [batches[i].tokens / c.times[i] for i in kept]

    peak = max(contender.peaks)
    mine = throughput(contender)
    row: dict[str, Any] = {
        "family": family,
        "contender": contender.name,
        "params_m": round(n_params / 1e6, 2),
        "budget_mib": round(budget / MIB, 2),
        "peak_mib": round(peak / MIB, 2),
        "peak_step": contender.peaks.index(peak) + 1,
        "steps_over_budget": sum(p > budget for p in contender.peaks),
        "fwd_bwd_peak_mib": round(max(contender.fwd_bwd) / MIB, 2),
        "resident_mib": round(resident / MIB, 2),
        "steps": len(batches),
        "steps_excluded": len(batches) - len(kept),
        "first_loss": round(contender.losses[0], 6),
        "first_loss_diff": abs(contender.losses[0] - by_name["original"].losses[0]),
        "last_loss": round(contender.losses[-1], 6),
    }
    if kept:
        seconds = sum(contender.times[i] for i in kept)
        row["tokens_per_s"] = round(sum(batches[i].tokens for i in kept) / seconds)
        row["padded_tokens_per_s"] = round(sum(batches[i].padded_tokens for i in kept) / seconds)
        for key, peer in (("vs_original", "original"), ("vs_hf", "hf_checkpointing")):
            ratio, spread = paired_ratio(mine, throughput(by_name[peer]))
            row[key], row[f"{key}_spread"] = round(ratio, 3), round(spread, 3)
    return row


# -- output -------------------------------------------------------------------------------


def commit() -> str:
    """The library's commit (``git rev-parse --short HEAD``), noting uncommitted changes
    under chkpt_opt/."""
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=root,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", "chkpt_opt"],
        capture_output=True,
        text=True,
        cwd=root,
    ).stdout.strip()
    return out.stdout.strip() + (" (chkpt_opt/ with uncommitted changes)" if dirty else "")


def _cell(row: dict[str, Any], key: str, digits: int = 2) -> str:
    value = row.get(key, "")
    if value == "" or value is None:
        return ""
    spread = row.get(f"{key}_spread")
    if spread not in (None, ""):
        return f"{value:.{digits}f} ± {spread:.{digits}f}"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, seconds: float) -> list[str]:
    command = "python benchmarks/finetune.py" + "".join(f" {shlex.quote(a)}" for a in sys.argv[1:])
    lines = [
        f"Command: `{command}`",
        "",
        f"Library commit: {commit()}; torch {torch.__version__}, CPU, "
        f"torch threads: {torch.get_num_threads()}; run took {seconds / 60:.1f} min.",
        "",
        f"Settings: {args.layers} layers (T5: each stack), width {args.width}, vocabulary "
        f"{VOCAB}, {args.steps} steps of {args.batch} sequences, lengths log-uniform in "
        f"[{MIN_LEN}, {args.max_len}] (T5 targets [{MIN_TARGET_LEN}, "
        f"{max(MIN_TARGET_LEN, args.max_len // 2)}]), padded to the longest; AdamW "
        f"(lr {LR}); chkpt_opt time limit {args.time_limit:g} s per solve; seed {args.seed}.",
        "",
        "Whole-step peak = resident bytes by chkpt_opt's formula (parameters, buffers, the "
        "batch, AdamW state) + the larger of the measured forward/backward peak (storage "
        "tracker, exact, gradients included) and the optimizer phase; the same for every "
        "contender. Budget = `hf_checkpointing`'s highest whole-step peak over the same "
        "batches (measured first); chkpt_opt is given it.",
        "",
        "| family | contender | peak MiB (budget) | over budget | fwd/bwd peak MiB "
        "| tokens/s (padded) | vs original | vs HF ckpt | steps excluded | loss diff step 1 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row.get("error"):
            lines.append(
                f"| {row['family']} | {row['contender']} | raised ({row['budget_mib']:.2f}) "
                "| | | | | | | |"
            )
            continue
        over = row["steps_over_budget"]
        lines.append(
            f"| {row['family']} | {row['contender']} | {row['peak_mib']:.2f} "
            f"({row['budget_mib']:.2f}) | {'no' if not over else f'{over} steps'} "
            f"| {row['fwd_bwd_peak_mib']:.2f} "
            f"| {row.get('tokens_per_s', '')} ({row.get('padded_tokens_per_s', '')}) "
            f"| {_cell(row, 'vs_original')} | {_cell(row, 'vs_hf')} "
            f"| {row['steps_excluded']}/{row['steps']} | {row['first_loss_diff']:.2e} |"
        )
    lines += [
        f"\n{row['family']}: chkpt_opt raised InfeasibleBudgetError at {row['error']}"
        for row in rows
        if row.get("error")
    ]
    lines += [
        "",
        "chkpt_opt's planning:",
        "",
        "| family | predicted peak MiB | prediction - measure MiB | first step prepare s "
        "| total prepare s | later shapes' share | solve s | captures | solves | reuses "
        "| resident = formula |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ours = [row for row in rows if row["contender"] == "chkpt_opt"]
    for row in ours:
        lines.append(
            f"| {row['family']} | {row['predicted_peak_mib']:.2f} "
            f"| {row['predicted_over_measured_mib']} | {row['first_prepare_s']:.1f} "
            f"| {row['total_prepare_s']:.1f} | {row['later_prepare_share']:.0%} "
            f"| {row['solve_s']:.1f} | {row['captures']} | {row['solves']} | {row['reuses']} "
            f"| {row['resident_matches_formula']} |"
        )
    lines += ["", "Captures (the step that met a new input signature, and its schedule):", ""]
    for row in ours:
        lines += [f"* {row['family']}: {row['schedules'] or 'none'}"]
    lines += [
        "",
        "Peak: the highest whole-step peak of any step, capture steps included; over budget: "
        "steps whose peak exceeded the budget (the original is there for reference: it has "
        "no budget). tokens/s: real (non-padding) tokens per second of whole steps (zero "
        "grads, forward, backward, AdamW step), padded tokens in brackets, over the steps "
        "kept; vs original / vs HF ckpt: the median of the per-step throughput ratios "
        "(the same for real and padded tokens: both count the same batch) ± twice their "
        "median absolute deviation, measured round-robin in the same rounds. Steps excluded: "
        "those where chkpt_opt captured a new input signature (planning included), left out "
        "of the throughput figures for every contender. Loss diff: |loss - original's loss| "
        "at the first step (same weights, batch and seed). Predicted peak: chkpt_opt's "
        "largest predicted whole-step peak of any shape (the first capture counts the "
        "logits held until the backward returns; its backward shows the loop drops them, "
        "and every later capture, the first batch's again included, counts them dropped); "
        "prediction - measure: the predicted whole-step peak of each capture against the "
        "measured peak of its step, in capture order. Resident = formula: steps served by a "
        "runner captured at their own shapes whose resident bytes equal the formula's. "
        "Later shapes' share: the part of the total prepare time spent after the first step.",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--time-limit", type=float, default=20.0, help="chkpt_opt's solve, s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: on a shared machine, 2 threads ran steps 7x slower)",
    )
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--quiet", action="store_true", help="hide chkpt_opt's log")
    args = parser.parse_args()
    if not args.quiet:
        logging.basicConfig(format="%(message)s", stream=sys.stderr)
        logging.getLogger("chkpt_opt").setLevel(logging.INFO)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for family in args.families:
        rows += run_family(family, args)
    seconds = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "finetune.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({key: row.get(key, "") for key in FIELDS})
    text = "\n".join(markdown(rows, args, seconds)) + "\n"
    (args.out / "finetune.md").write_text(text)
    print(text)
    log(f"wrote {args.out / 'finetune.csv'} and finetune.md in {seconds / 60:.1f} min")


if __name__ == "__main__":
    main()
