"""DistributedDataParallel over a model with a plan attached gives the gradients of DDP over
the original (gloo, two CPU processes, batches of other lengths on each rank); a plan made
for one rank under DDP keeps the measured per-rank peak within its budget, predicted within
3% (DDP's gradient buckets, allocated at construction, counted resident)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.attachment.rank_memory import close, local_bytes
from tests.attachment.tiny_models import tiny_llama

transformers = pytest.importorskip("transformers")

VOCAB = 256
WORLD = 2


def _model() -> torch.nn.Module:
    return tiny_llama(vocab=VOCAB, layers=2, intermediate=128, max_positions=128)


def _ranks_steps(rank: int, store: str, out: str) -> None:
    import chkpt_opt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        original = _model()
        planned = chkpt_opt.optimize(
            copy.deepcopy(original), budget=10**9, time_limit_s=5, profile_times=False
        )
        contenders = {
            "original": torch.nn.parallel.DistributedDataParallel(original),
            "planned": torch.nn.parallel.DistributedDataParallel(planned),
        }
        grads: dict[str, list[dict[str, torch.Tensor]]] = {name: [] for name in contenders}
        gen = torch.Generator().manual_seed(10 + rank)
        for seq in (24 + 8 * rank, 16):
            ids = torch.randint(0, VOCAB, (2, seq), generator=gen)
            for name, ddp in contenders.items():
                ddp.zero_grad(set_to_none=True)
                ddp(input_ids=ids, labels=ids).loss.backward()
                named = ddp.module.named_parameters()
                grads[name].append({n: p.grad.clone() for n, p in named})
        torch.save(grads, os.path.join(out, f"rank{rank}.pt"))
        peaks = _rank_peaks(torch.randint(0, VOCAB, (2, 48 + 16 * rank), generator=gen))
        Path(out, f"rank{rank}.json").write_text(json.dumps(peaks))
    finally:
        dist.destroy_process_group()


def _rank_peaks(ids: torch.Tensor) -> dict[str, int]:
    """One rank's SGD step under DDP, planned for the rank with a budget halfway between
    every layer checkpointed and none: the budget, and the predicted and measured peaks
    (every storage from DDP's construction on, plus the parameters and the batch) of the
    plan and of the original."""
    import chkpt_opt
    from chkpt_opt.attachment.held_outputs import dropping_outputs
    from chkpt_opt.export.layers import find_layers
    from chkpt_opt.graphs.tracer.storage import StorageTracker
    from chkpt_opt.memory_model.schedule import Schedule
    from chkpt_opt.step_budget.sharding import Sharding
    from chkpt_opt.step_budget.whole_step import static_memory_for

    batch = {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
    sharding = Sharding(world_size=WORLD, strategy="ddp")
    graph = dropping_outputs(chkpt_opt.trace(_model(), (), batch))  # the loop keeps the loss
    static = static_memory_for(graph, "sgd", sharding=sharding)
    every = chkpt_opt.simulate(graph, Schedule.from_spans(graph, list(find_layers(graph).spans)))
    none = chkpt_opt.simulate(graph, Schedule())
    budget = static.step_peak_bytes((every.peak_bytes + none.peak_bytes) // 2)
    planned = chkpt_opt.optimize(
        _model(),
        budget=budget,
        sharding=sharding,
        optimizer="sgd",
        example_kwargs=batch,
        outputs_held=False,
        time_limit_s=5,
        profile_times=False,
    )
    (runner,) = chkpt_opt.attachment_of(planned).runners  # type: ignore[union-attr]
    peaks = {
        "budget": budget,
        "planned_predicted": runner.predicted_peak_bytes,
        "original_predicted": static.step_peak_bytes(none.peak_bytes),
    }
    for name, model in (("original", _model()), ("planned", planned)):
        resident = local_bytes([*model.parameters(), *model.buffers(), ids, batch["labels"]])
        with StorageTracker() as tracker:
            ddp = torch.nn.parallel.DistributedDataParallel(model)  # its buckets
            optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, foreach=False)
            ddp(**batch).loss.backward()
            optimizer.step()
        peaks[name] = resident + tracker.peak_bytes
    return peaks


def test_ddp_gradients_equal_ddp_over_the_original(tmp_path: Path) -> None:
    mp.spawn(_ranks_steps, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD)
    for rank in range(WORLD):
        grads = torch.load(tmp_path / f"rank{rank}.pt")
        for planned, original in zip(grads["planned"], grads["original"], strict=True):
            assert planned.keys() == original.keys()
            assert all(torch.equal(planned[n], original[n]) for n in original), rank
        peaks = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert peaks["planned"] <= peaks["budget"] < peaks["original"], peaks
        for name in ("original", "planned"):
            assert close(peaks[f"{name}_predicted"], peaks[name]), (name, peaks)
