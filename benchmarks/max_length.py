"""What a budget buys: the longest sequence and the largest batch each strategy fits in it.

Run:
    python benchmarks/max_length.py --quick            # 8 layers, LoRA, coarse grid (minutes)
    python benchmarks/max_length.py --layers 8 32 --mode lora full --time-limit 20

Models: Hugging Face ``LlamaForCausalLM`` from a ``LlamaConfig`` (hidden 256, intermediate 688,
4 heads, vocabulary 2048, ``--layers`` layers, ``use_cache=False``), random weights, nothing
downloaded. ``lora``: ``peft.get_peft_model`` with r=8 on ``q_proj``/``v_proj`` (the base weights
frozen: activations dominate the step); ``full``: every weight trained, for reference. Each
step is ``optimizer.zero_grad(); model(input_ids=x, labels=x).loss.backward(); optimizer.step()``
with AdamW over the trainable parameters; random token ids, seeded.

Budget ``B``: the measured whole-step peak of HF checkpointing at ``--ref-len`` tokens and
``--batch`` sequences.

Contenders, each a fresh deep copy of the model for every shape probed:

* ``original``: no checkpointing;
* ``hf_checkpointing``: ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=
  {"use_reentrant": False})``;
* ``sac``: PyTorch's selective activation checkpointing around each decoder layer: the same
  HF per-layer checkpoint with ``context_fn`` = ``create_selective_checkpoint_contexts`` of a
  policy that saves ``aten.mm``/``addmm``/``bmm`` and SDPA outputs (the usual SAC recipe);
* ``chkpt_opt``: ``chkpt_opt.plan(copy, (), example_kwargs=batch, budget=B,
  time_limit_s=--time-limit, outputs_held=False)`` then ``plan.apply()``, planned at each shape
  it is probed at (the loop drops the logits before the backward pass);
  ``InfeasibleBudgetError`` = does not fit (its smallest feasible budget is recorded). The
  same planner as ``chkpt_opt.optimize(..., outputs_held=False)`` with one capture: the
  attachment captures a ``PeftModel`` twice (fixed shapes, then symbolic sizes, discarded as
  "another program"), which took 73-85 s of a 60 s limit on this loaded machine and left the
  solver nothing (the log of that run is kept beside the results). Op times are estimated
  (roofline, deterministic) unless ``--profile-times``.

Memory is measured as ``benchmarks/finetune.py`` measures it (one step run, then the
forward/backward peak by the exact storage tracker, plus the resident bytes of
``chkpt_opt.step_budget.budget.static_memory`` and the optimizer phase). A shape fits when
that whole-step peak is at most ``B``. The longest length: on a grid of ``--grid`` tokens,
doubling (or halving) from ``--ref-len`` until the fit changes, then bisection. The largest
batch at ``--ref-len``: the same search over batches from 1.

Time: at each contender's longest length, that contender and chkpt_opt (planned at that
length) run ``--rounds`` steps interleaved; the time ratio chkpt_opt / peer is the median of
the per-round ratios ± twice their median absolute deviation (``peers.paired_ratio``), the
peer's time per token is its median step time / tokens (a shared machine: read the ratios).

What bounds chkpt_opt: at its longest length (and the next grid length, where it failed) the
cost graph (``chkpt_opt.trace``, outputs dropped as the attachment plans) gives the lowest
peak the solvers find (``chkpt_opt.smallest_peak``) with its proven floor, the bytes of the
lm_head and loss ops (logits, their float copy, log-softmax and their gradients: created
whatever the schedule) and the largest decoder layer's saved bytes (what one layer's
backward needs at once).

Writes max_length.json and max_length.md to ``--out`` (benchmarks/results/max_length).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import logging
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from finetune import Batch, Contender, commit, fwd_bwd_peak, log, resident_of, train_step
from peers import paired_ratio
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import chkpt_opt
from chkpt_opt.errors import InfeasibleBudgetError

CONTENDERS = ("original", "hf_checkpointing", "sac", "chkpt_opt")
VOCAB = 2048
HIDDEN = 256
INTERMEDIATE = 688
HEADS = 4
LR = 1e-4
MIB = 2**20
OUT = Path(__file__).resolve().parent / "results" / "max_length"

aten = torch.ops.aten
SAC_SAVE = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
}


# -- models and contenders ----------------------------------------------------------------


def build(layers: int, mode: str, seed: int = 0) -> nn.Module:
    """The Llama of the module docstring, LoRA-wrapped for ``mode == "lora"``, in train mode."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=1 << 16,
        use_cache=False,
    )
    torch.manual_seed(seed)
    model: nn.Module = transformers.LlamaForCausalLM(config)
    if mode == "lora":
        import peft

        lora = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        model = peft.get_peft_model(model, lora)
    elif mode != "full":
        raise ValueError(f"unknown mode {mode!r}; choose lora or full")
    return model.train()


def make_batch(batch: int, length: int, seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (batch, length), generator=gen)
    return Batch({"input_ids": ids, "labels": ids.clone()}, ids.numel(), ids.numel())


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAC_SAVE else CheckpointPolicy.PREFER_RECOMPUTE


class WithKwargs(nn.Module):
    """``inner`` called with ``extra`` keyword arguments added."""

    def __init__(self, inner: nn.Module, extra: dict[str, Any]) -> None:
        super().__init__()
        self.inner = inner
        self.extra = extra

    def forward(self, **kwargs: Any) -> Any:
        return self.inner(**kwargs, **self.extra)


@dataclass
class Prepared:
    """A contender's model for one shape, or why it has none."""

    model: nn.Module | None
    prepare_s: float = 0.0
    infeasible: str = ""
    min_feasible_bytes: int | None = None
    min_feasible_exact: bool = False
    predicted_bytes: int | None = None
    plan: dict[str, Any] | None = None
    owner: nn.Module | None = None


def prepare(
    name: str,
    base: nn.Module,
    batch: Batch,
    budget: int,
    time_limit_s: float,
    profile_times: bool = False,
) -> Prepared:
    """A deep copy of ``base`` set up as contender ``name`` for ``batch``."""
    model = copy.deepcopy(base)
    start = time.perf_counter()
    if name in ("hf_checkpointing", "sac"):
        kwargs: dict[str, Any] = {"use_reentrant": False}
        if name == "sac":
            kwargs["context_fn"] = functools.partial(
                create_selective_checkpoint_contexts, _save_matmuls
            )
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    elif name == "chkpt_opt":
        try:
            made = chkpt_opt.plan(
                model,
                (),
                example_kwargs=batch.inputs,
                budget=budget,
                time_limit_s=time_limit_s,
                outputs_held=False,
                profile_times=profile_times,
            )
        except InfeasibleBudgetError as err:
            return Prepared(
                None,
                time.perf_counter() - start,
                infeasible=str(err).split(". ")[0],
                min_feasible_bytes=err.min_feasible_bytes,
                min_feasible_exact=err.exact,
            )
        stats = made.result.stats
        return Prepared(
            WithKwargs(made.apply(), {"use_cache": False}),  # as plan() captured it
            time.perf_counter() - start,
            owner=model,
            predicted_bytes=made.static.step_peak_bytes(made.profile.peak_bytes),
            plan={
                "status": str(made.result.status),
                "regions": len(made.schedule.regions),
                "extra_compute": made.result.objective,
                "bound": made.result.bound,
                "planning_s": stats.get("planning_s"),
            },
        )
    elif name != "original":
        raise ValueError(f"unknown contender {name!r}; choose from {', '.join(CONTENDERS)}")
    return Prepared(model, time.perf_counter() - start)


def contender(name: str, model: nn.Module, owner: nn.Module) -> Contender:
    """``model`` trained by AdamW over ``owner``'s trainable parameters (the model whose
    Parameters a plan's applied module shares)."""
    trainable = [p for p in owner.parameters() if p.requires_grad]
    return Contender(name, model, torch.optim.AdamW(trainable, lr=LR))


# -- probes and searches ------------------------------------------------------------------


@dataclass
class Probe:
    """One shape run by one contender."""

    contender: str
    batch: int
    length: int
    fits: bool
    peak_bytes: int | None
    prepare_s: float
    step_s: float | None = None
    note: str = ""
    predicted_bytes: int | None = None
    min_feasible_bytes: int | None = None
    min_feasible_exact: bool = False
    plan: dict[str, Any] | None = None


@dataclass
class Bench:
    base: nn.Module
    budget: int
    args: argparse.Namespace
    probes: list[Probe] = field(default_factory=list)
    ready: dict[tuple[str, int, int], Contender] = field(default_factory=dict)
    progress: Path | None = None
    layers: int = 0

    def seed(self, batch: int, length: int) -> int:
        return self.args.seed * 100_003 + batch * 8191 + length

    def probe(self, name: str, batch: int, length: int) -> Probe:
        for done in self.probes:
            if (done.contender, done.batch, done.length) == (name, batch, length):
                return done
        data = make_batch(batch, length, self.seed(batch, length))
        made = prepare(
            name, self.base, data, self.budget, self.args.time_limit, self.args.profile_times
        )
        if made.model is None:
            result = Probe(
                name,
                batch,
                length,
                False,
                None,
                made.prepare_s,
                note=made.infeasible,
                min_feasible_bytes=made.min_feasible_bytes,
                min_feasible_exact=made.min_feasible_exact,
            )
        else:
            runner = contender(name, made.model, made.owner or made.model)
            try:
                train_step(runner, data, self.seed(batch, length))
                fwd_bwd = fwd_bwd_peak(runner.model, data, self.seed(batch, length))
            except Exception as err:  # a plan that does not run counts as not fitting
                log(f"  {name} batch {batch} x {length}: the step raised {err!r:.300}")
                result = Probe(
                    name,
                    batch,
                    length,
                    False,
                    None,
                    made.prepare_s,
                    note=f"step raised {type(err).__name__}: {str(err)[:200]}",
                    predicted_bytes=made.predicted_bytes,
                    plan=made.plan,
                )
            else:
                peak = resident_of(self.base, data).step_peak_bytes(fwd_bwd)
                result = Probe(
                    name,
                    batch,
                    length,
                    peak <= self.budget,
                    peak,
                    made.prepare_s,
                    step_s=runner.times[-1],
                    predicted_bytes=made.predicted_bytes,
                    plan=made.plan,
                )
            if result.fits:
                self.ready[(name, batch, length)] = runner
        self.probes.append(result)
        if self.progress is not None:  # every probe as it is measured, for a cut-short run
            with open(self.progress, "a") as handle:
                handle.write(json.dumps({"layers": self.layers, **vars(result)}) + "\n")
        log(
            f"  {name} batch {batch} x {length}: "
            + (
                f"peak {result.peak_bytes / MIB:.2f} MiB"
                if result.peak_bytes is not None
                else (result.note[:60] if result.note.startswith("step raised") else "no plan")
            )
            + f" ({'fits' if result.fits else 'over'} {self.budget / MIB:.2f} MiB)"
            + (f", prepared in {result.prepare_s:.1f} s" if result.prepare_s > 1 else "")
            + (
                f", predicted {result.predicted_bytes / MIB:.2f} MiB"
                if result.predicted_bytes
                else ""
            )
            + (
                f", smallest budget met {result.min_feasible_bytes / MIB:.2f} MiB"
                if result.min_feasible_bytes
                else ""
            )
        )
        return result

    def runner(self, name: str, batch: int, length: int) -> Contender:
        if (name, batch, length) not in self.ready:  # released (or measured elsewhere)
            self.probes = [
                p for p in self.probes if (p.contender, p.batch, p.length) != (name, batch, length)
            ]
            self.probe(name, batch, length)
        if (name, batch, length) not in self.ready:
            raise RuntimeError(f"{name} does not fit batch {batch} x {length}")
        return self.ready[(name, batch, length)]

    def release(self, keep: set[tuple[str, int, int]]) -> None:
        for key in list(self.ready):
            if key not in keep:
                del self.ready[key]


def largest(fits: Callable[[int], bool], start: int, step: int, limit: int) -> int:
    """The largest multiple of ``step`` (at most ``limit``) that fits, assuming fitting is
    monotone: doubling or halving from ``start`` until the answer changes, then bisection
    on the grid; 0 where not even ``step`` fits."""
    start = max(step, start // step * step)
    if fits(start):
        lo, hi = start, None
        while hi is None:
            nxt = min(lo * 2, limit)
            if nxt == lo:
                return lo
            if fits(nxt):
                lo = nxt
            else:
                hi = nxt
    else:
        lo, hi = 0, start
        while hi > step:
            nxt = max(step, hi // 2 // step * step)
            if fits(nxt):
                lo = nxt
                break
            hi = nxt
        if lo == 0:
            return 0
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


# -- what bounds chkpt_opt ----------------------------------------------------------------


def graph_at(base: nn.Module, data: Batch, budget: int) -> tuple[Any, Any, int]:
    """The cost graph chkpt_opt plans at this shape (a copy of ``base`` traced, the logits
    dropped before the backward pass, as the attachment plans), its static memory and the
    activation budget ``budget`` leaves."""
    from chkpt_opt.attachment.held_outputs import dropping_outputs
    from chkpt_opt.step_budget.whole_step import activation_budget

    graph = dropping_outputs(chkpt_opt.trace(copy.deepcopy(base), (), data.inputs))
    _, static, act = activation_budget(graph, budget)
    return graph, static, act


def bounds_at(base: nn.Module, data: Batch, budget: int, time_limit_s: float) -> dict[str, Any]:
    """The cost graph's figures at this shape (see the module docstring), whole-step bytes."""
    graph, static, act = graph_at(base, data, budget)
    lowest = chkpt_opt.smallest_peak(graph, time_limit_s=time_limit_s)
    keep_all = chkpt_opt.simulate(graph, chkpt_opt.Schedule()).peak_bytes
    nodes = sorted(graph.nodes(data=True), key=lambda item: item[1]["index"])
    head_from = next(
        (attrs["index"] for _, attrs in nodes if attrs["module_path"].endswith("lm_head")), None
    )
    head: dict[str, int] = {}
    layers: dict[str, dict[str, int]] = {}
    for _, attrs in nodes:
        if head_from is not None and attrs["index"] >= head_from:
            head.update(attrs["outputs"])
            head.update(attrs["saved"])
        path = attrs["module_path"]
        if ".layers." in path:
            parts = path.split(".layers.", 1)
            layer = parts[0] + ".layers." + parts[1].split(".", 1)[0]
            layers.setdefault(layer, {}).update(attrs["saved"])
    head_bytes = sum(head.values())
    head_grad_bytes = max(
        (attrs["grad_bytes"] for _, attrs in nodes if attrs["index"] == head_from), default=0
    )
    layer_bytes = max((sum(s.values()) for s in layers.values()), default=0)
    floor = lowest.stats.get("min_feasible_lower_bytes")
    cover = lowest.stats.get("recompute_bound")
    floor_all = cover.get("floor_bytes") if isinstance(cover, dict) else None
    return {
        "ops": graph.number_of_nodes(),
        "resident_bytes": static.resident_bytes,
        "activation_budget_bytes": act,
        "keep_all_step_bytes": static.step_peak_bytes(keep_all),
        "lowest_step_bytes": static.step_peak_bytes(lowest.peak_bytes),
        "lowest_status": str(lowest.status),
        "lowest_proven": bool(lowest.stats.get("min_feasible_proven")),
        "floor_step_bytes": static.step_peak_bytes(floor) if floor else None,
        "floor_all_schedules_step_bytes": static.step_peak_bytes(floor_all) if floor_all else None,
        "head_bytes": head_bytes,
        "head_grad_bytes": head_grad_bytes,
        "largest_layer_saved_bytes": layer_bytes,
        "lowest_fwd_bwd_bytes": lowest.peak_bytes,
    }


# -- one row ------------------------------------------------------------------------------


def timed_pair(bench: Bench, peer: str, batch: int, length: int, rounds: int) -> dict[str, Any]:
    """``rounds`` steps of chkpt_opt and ``peer`` at this shape, interleaved (alternating
    which runs first): the peer's time per token and chkpt_opt's time ratio to it."""
    ours = bench.runner("chkpt_opt", batch, length)
    theirs = bench.runner(peer, batch, length) if peer != "chkpt_opt" else ours
    data = make_batch(batch, length, bench.seed(batch, length))
    seed = bench.seed(batch, length)
    pair = [ours, theirs] if theirs is not ours else [ours]
    start = {id(c): len(c.times) for c in pair}
    for round_ in range(rounds):
        for c in pair if round_ % 2 == 0 else pair[::-1]:
            train_step(c, data, seed)
    ours_s = ours.times[start[id(ours)] :]
    theirs_s = theirs.times[start[id(theirs)] :]
    ratio, spread = paired_ratio(ours_s, theirs_s)
    return {
        "peer": peer,
        "length": length,
        "batch": batch,
        "rounds": rounds,
        "peer_ms_per_token": round(1e3 * statistics.median(theirs_s) / data.tokens, 4),
        "chkpt_opt_ms_per_token": round(1e3 * statistics.median(ours_s) / data.tokens, 4),
        "time_ratio": round(ratio, 3),
        "time_ratio_spread": round(spread, 3),
    }


def run_row(layers: int, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    base = build(layers, mode, seed=args.seed)
    n_params = sum(p.numel() for p in base.parameters())
    n_train = sum(p.numel() for p in base.parameters() if p.requires_grad)
    log(
        f"== {layers} layers, {mode}: {n_params / 1e6:.2f} M parameters, "
        f"{n_train / 1e6:.3f} M trained"
    )
    reference = Bench(base, 1 << 60, args)
    ref = reference.probe("hf_checkpointing", args.batch, args.ref_len)
    assert ref.peak_bytes is not None
    budget = ref.peak_bytes
    log(f"budget {budget / MIB:.2f} MiB: HF checkpointing at {args.batch} x {args.ref_len}")
    bench = Bench(base, budget, args, progress=args.progress, layers=layers)
    bench.probes.append(ref)
    bench.ready.update(reference.ready)
    longest: dict[str, int] = {}
    widest: dict[str, int] = {}
    for name in args.contenders:
        log(f"{name}: longest sequence at batch {args.batch}")
        longest[name] = largest(
            lambda n, name=name: bench.probe(name, args.batch, n).fits,
            args.ref_len,
            args.grid,
            args.max_len,
        )
        log(f"{name}: longest {longest[name]} tokens")
        bench.release({(c, args.batch, n) for c in longest for n in longest.values()})
    for name in args.contenders:
        if args.no_batch:
            break
        log(f"{name}: largest batch at {args.ref_len} tokens")
        widest[name] = largest(
            lambda b, name=name: bench.probe(name, b, args.ref_len).fits, 1, 1, args.max_batch
        )
        log(f"{name}: largest batch {widest[name]}")
        bench.release({(c, args.batch, n) for c in longest for n in longest.values()})
    timings = []
    if "chkpt_opt" in args.contenders:
        for name in args.contenders:
            length = longest[name]
            if name not in args.time_against or not length or longest.get("chkpt_opt", 0) < length:
                continue
            log(f"timing chkpt_opt against {name} at {args.batch} x {length}")
            timings.append(timed_pair(bench, name, args.batch, length, args.rounds))
            log(f"  {timings[-1]}")
            bench.release({(c, args.batch, n) for c in longest for n in longest.values()})
    analysis: dict[str, Any] = {}
    top = longest.get("chkpt_opt", 0)
    if top and not args.no_bounds:
        for length in (top,):
            log(f"what bounds chkpt_opt at {args.batch} x {length}")
            data = make_batch(args.batch, length, bench.seed(args.batch, length))
            analysis[str(length)] = bounds_at(base, data, budget, args.time_limit)
            log(f"  {analysis[str(length)]}")
    row = {
        "layers": layers,
        "mode": mode,
        "params_m": round(n_params / 1e6, 3),
        "trainable_m": round(n_train / 1e6, 4),
        "batch": args.batch,
        "ref_len": args.ref_len,
        "budget_bytes": budget,
        "longest": longest,
        "largest_batch": widest,
        "timings": timings,
        "bounds": analysis,
        "probes": [vars(p) for p in bench.probes],
        "seconds": round(time.perf_counter() - started, 1),
    }
    log(f"== {layers} layers, {mode}: done in {row['seconds']:.0f} s")
    return row


# -- output -------------------------------------------------------------------------------


def _mib(value: int | None) -> str:
    return "" if value is None else f"{value / MIB:.2f}"


def _share(part: int, whole: int) -> str:
    return f"{part / MIB:.2f} ({part / whole:.0%})" if whole else ""


def markdown(
    rows: list[dict[str, Any]], args: argparse.Namespace, command: str, commit_text: str
) -> list[str]:
    lines = [
        "# What a budget buys: longest sequence and largest batch per strategy",
        "",
        f"Command: `{command}`",
        "",
        f"Library commit: {commit_text}; torch {torch.__version__}, CPU, torch threads "
        f"{args.threads}; Python recursion limit "
        f"{getattr(args, 'recursion_limit', 0) or 'as shipped (1000)'}; "
        f"chkpt_opt time limit {args.time_limit:g} s per plan, "
        f"op times {'measured' if args.profile_times else 'estimated (roofline)'}; grid "
        f"{args.grid} tokens; timing rounds {args.rounds}; seed {args.seed}.",
        "",
        f"Llama (hidden {HIDDEN}, intermediate {INTERMEDIATE}, {HEADS} heads, vocabulary {VOCAB}, "
        "random weights, `use_cache=False`); LoRA = peft r=8 on q_proj/v_proj. Budget = HF "
        f"checkpointing's measured whole-step peak at batch {args.batch} x {args.ref_len} "
        "tokens (AdamW over the trainable parameters). Peaks: one step run, the forward/"
        "backward peak by chkpt_opt's exact storage tracker, plus the resident bytes "
        "(`static_memory`) and the optimizer phase, as `benchmarks/finetune.py` measures.",
        "",
        "| layers | mode | budget MiB (resident) | contender | longest tokens | vs HF "
        f"| largest batch at {args.ref_len} | ms/token at its longest "
        "| chkpt_opt time ratio at that length |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        hf = row["longest"].get("hf_checkpointing") or 0
        resident = next((b["resident_bytes"] for b in row["bounds"].values()), None)
        budget = f"{_mib(row['budget_bytes'])}" + (f" ({_mib(resident)})" if resident else "")
        timing = {t["peer"]: t for t in row["timings"]}
        for name, length in row["longest"].items():
            t = timing.get(name)
            ms = t["peer_ms_per_token"] if t else ""
            ratio = (
                f"{t['time_ratio']:.2f} ± {t['time_ratio_spread']:.2f}"
                if t and name != "chkpt_opt"
                else ""
            )
            lines.append(
                f"| {row['layers']} | {row['mode']} | {budget} | {name} | {length} "
                f"| {length / hf:.3f}x | {row['largest_batch'].get(name, '')} | {ms} | {ratio} |"
                if hf
                else f"| {row['layers']} | {row['mode']} | {budget} | {name} | {length} | "
                f"| {row['largest_batch'].get(name, '')} | {ms} | {ratio} |"
            )
    lines += [
        "",
        "Time ratio: chkpt_opt's step time / the peer's at the peer's longest length (chkpt_opt "
        "planned for that length under the same budget), median of per-round ratios ± twice "
        "their median absolute deviation, steps interleaved in one run. ms/token: median step "
        "time / tokens on this shared machine (read the ratios, not the absolute times).",
        "",
        "## What bounds chkpt_opt (cost graph, whole-step MiB)",
        "",
        "| layers | mode | tokens | budget | resident | keep-all | lowest found (proven?) "
        "| floor | logits+loss ops, MiB (share of lowest's fwd/bwd) | largest layer saved "
        "(share) | next length: smallest budget met |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        probes = {p["length"]: p for p in row["probes"] if p["contender"] == "chkpt_opt"}
        for length, b in row["bounds"].items():
            lowest = b["lowest_step_bytes"]
            fwd_bwd = b["lowest_fwd_bwd_bytes"]
            floor = b["floor_all_schedules_step_bytes"] or b["floor_step_bytes"]
            after = probes.get(int(length) + args.grid)
            met = ""
            if after and after["min_feasible_bytes"]:
                met = f"{int(length) + args.grid}: {_mib(after['min_feasible_bytes'])}" + (
                    " (proven)" if after["min_feasible_exact"] else ""
                )
            elif after and after["peak_bytes"]:
                met = f"{int(length) + args.grid}: planned, measured {_mib(after['peak_bytes'])}"
            elif after and after["note"]:
                met = (
                    f"{int(length) + args.grid}: planned (predicted "
                    f"{_mib(after['predicted_bytes'])}), {after['note'][:40]}"
                )
            lines.append(
                f"| {row['layers']} | {row['mode']} | {length} | {_mib(row['budget_bytes'])} "
                f"| {_mib(b['resident_bytes'])} | {_mib(b['keep_all_step_bytes'])} "
                f"| {_mib(lowest)} ({'yes' if b['lowest_proven'] else 'no'}) "
                f"| {_mib(floor) or 'none'} "
                f"| {_share(b['head_bytes'] + b['head_grad_bytes'], fwd_bwd)} "
                f"| {_share(b['largest_layer_saved_bytes'], fwd_bwd)} | {met} |"
            )
    lines += [
        "",
        "Lowest found: `chkpt_opt.smallest_peak` on the graph the attachment plans (logits "
        "dropped before the backward pass) within the time limit; floor: its proven lower bound "
        "(over every schedule where the recompute bound gives one, else keep-set), 'none' where "
        "the solvers proved nothing in the time. Logits+loss ops: bytes of every storage the "
        "lm_head and loss ops create or save (logits, the log-softmax buffer, ...) plus the "
        "logits' gradient, created whatever the schedule; "
        "largest layer saved: the saved storages of the largest decoder layer, which its "
        "backward needs at once. Shares are of the forward/backward part of the lowest peak "
        "found (the step peak less the resident bytes).",
        "",
        "## chkpt_opt's probes",
        "",
        "| layers | mode | batch x tokens | result | measured MiB | predicted MiB | plan "
        "| prepare s | smallest budget met MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for p in row["probes"]:
            if p["contender"] != "chkpt_opt":
                continue
            plan = p.get("plan") or {}
            if p["fits"]:
                result = "fits"
            elif p["peak_bytes"] is not None:
                result = "over"
            elif p["note"].startswith("step raised"):
                result = p["note"][:60]
            else:
                result = "no plan"
            described = (
                f"{plan['regions']} regions, {plan['status']}, extra {plan['extra_compute']:.3g} s"
                if plan
                else ""
            )
            met = _mib(p["min_feasible_bytes"]) + (" (proven)" if p["min_feasible_exact"] else "")
            lines.append(
                f"| {row['layers']} | {row['mode']} | {p['batch']} x {p['length']} | {result} "
                f"| {_mib(p['peak_bytes'])} | {_mib(p['predicted_bytes'])} | {described} "
                f"| {p['prepare_s']:.0f} | {met if p['min_feasible_bytes'] else ''} |"
            )
    lines += [
        "",
        "Extra: the plan's estimated extra compute (roofline seconds of recomputation). "
        "Prepare: planning and applying, seconds (capture included; it may overrun the time "
        "limit). Smallest budget met: what `InfeasibleBudgetError` states.",
        "",
        "Rows run: "
        + "; ".join(f"{r['layers']} layers {r['mode']} ({r['seconds']:.0f} s)" for r in rows)
        + ".",
    ]
    return lines


def main_parser() -> argparse.ArgumentParser:
    """The command line's options (``benchmarks/results/max_batch/measure.py`` reads them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--mode", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS)
    parser.add_argument("--ref-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--grid", type=int, default=64, help="sequence lengths searched, tokens")
    parser.add_argument("--max-len", type=int, default=16384)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--time-limit", type=float, default=120.0, help="per chkpt_opt plan, s")
    parser.add_argument("--profile-times", action="store_true", help="measure op times to plan")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument(
        "--time-against",
        nargs="+",
        default=list(CONTENDERS),
        choices=CONTENDERS,
        help="peers chkpt_opt is timed against at their longest lengths",
    )
    parser.add_argument("--no-batch", action="store_true", help="skip the largest-batch search")
    parser.add_argument("--no-bounds", action="store_true", help="skip the cost-graph figures")
    parser.add_argument("--quick", action="store_true", help="8 layers, LoRA, 3 rounds")
    parser.add_argument(
        "--recursion-limit",
        type=int,
        default=0,
        help="raise Python's recursion limit to this (0: as is): deeply nested plans exceed "
        "the default when they run (benchmarks/results/max_length/nested_recursion_repro.py)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--name", default="", help="output file suffix (default: from layers)")
    parser.add_argument("--quiet", action="store_true", help="hide chkpt_opt's log")
    parser.add_argument("--render", type=Path, help="rewrite the Markdown of this JSON file")
    return parser


def main() -> None:
    args = main_parser().parse_args()
    if args.render:
        payload = json.loads(args.render.read_text())
        settings = argparse.Namespace(**payload["settings"])
        text = markdown(payload["rows"], settings, payload["command"], payload["commit"])
        text = "\n".join(text) + "\n"
        args.render.with_suffix(".md").write_text(text)
        print(text)
        return
    if args.quick:
        args.layers, args.mode, args.grid, args.rounds = [8], ["lora"], 64, 3
    if not args.quiet:
        logging.basicConfig(format="%(asctime)s %(message)s", stream=sys.stderr)
        logging.getLogger("chkpt_opt").setLevel(logging.INFO)
    torch.set_num_threads(args.threads)
    if args.recursion_limit:
        sys.setrecursionlimit(args.recursion_limit)
    command = "python benchmarks/max_length.py" + "".join(
        f" {shlex.quote(a)}" for a in sys.argv[1:]
    )
    rows = []
    name = args.name or (
        "quick" if args.quick else "_".join(f"{n}" for n in args.layers) + "_" + "_".join(args.mode)
    )
    args.out.mkdir(parents=True, exist_ok=True)
    args.progress = args.out / f"max_length_{name}.probes.jsonl"
    args.progress.unlink(missing_ok=True)
    for layers in args.layers:
        for mode in args.mode:
            rows.append(run_row(layers, mode, args))
            payload = {
                "command": command,
                "commit": commit(),
                "torch": torch.__version__,
                "settings": {
                    k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                },
                "rows": rows,
            }
            (args.out / f"max_length_{name}.json").write_text(json.dumps(payload, indent=1) + "\n")
            text = "\n".join(markdown(rows, args, command, commit())) + "\n"
            (args.out / f"max_length_{name}.md").write_text(text)
    print(text)
    log(f"wrote {args.out}/max_length_{name}.json and .md")


if __name__ == "__main__":
    main()
