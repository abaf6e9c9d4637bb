"""FSDP2 (``fully_shard`` per layer and at the root) over a plain PyTorch model with a
layer-wise plan attached: the gradients of FSDP2 over the original, a measured per-rank
peak within the per-rank budget, and the predicted per-rank peak (FSDP2's buffers placed
in time) within 3% of the measured one, with the plan and without, and under a
bf16 ``MixedPrecisionPolicy`` (gloo, two CPU processes). Nothing here imports
transformers, so the processes start and plan in seconds (the Llama case, slower, is in
``test_fsdp2.py``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.attachment.rank_memory import (
    close,
    gathered_buffers,
    layerwise_facts,
    local_bytes,
)

WORLD = 2


class _Stack(torch.nn.Module):
    """Three MLP layers between an input projection and a head: no transformers import,
    so the two processes start and plan in seconds."""

    def __init__(
        self, features: int = 16, width: int = 32, hidden: int = 128, classes: int = 4
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(features, width)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(width, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, width)
            )
            for _ in range(3)
        )
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x).square().mean()


def _stack_budget_bytes(x: torch.Tensor) -> tuple[int, int]:
    """The budget (halfway between every layer checkpointed and none, the FSDP2 buffers
    counted as the budget split's upper bound) and the predicted peak without a plan."""
    import chkpt_opt
    from chkpt_opt.export.layers import find_layers
    from chkpt_opt.memory_model.schedule import Schedule
    from chkpt_opt.step_budget.sharding import Sharding, per_rank_graph, predicted_rank_peak_bytes
    from chkpt_opt.step_budget.whole_step import static_memory_for

    graph = chkpt_opt.trace(_Stack(), (x,))
    sharding = Sharding(world_size=WORLD)
    rank = per_rank_graph(graph, sharding)
    low = chkpt_opt.simulate(rank, Schedule.from_spans(rank, list(find_layers(rank).spans)))
    high = chkpt_opt.simulate(rank, Schedule.from_spans(rank, []))
    static = static_memory_for(graph, "sgd", sharding=sharding)
    original = predicted_rank_peak_bytes(rank, Schedule(), sharding, static)
    return static.resident_bytes + (low.peak_bytes + high.peak_bytes) // 2, original


def _mixed_precision_peaks(x: torch.Tensor) -> dict[str, int]:
    """FSDP2 with fp32 sharded parameters computing in bf16 (``MixedPrecisionPolicy``),
    every layer checkpointed whole or none: predicted from a trace of the model in bf16
    (``master_element_bytes=4``) and measured, the batch given in bf16."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import chkpt_opt
    from chkpt_opt.attachment.layerwise import CheckpointedForward
    from chkpt_opt.export.layers import find_layers
    from chkpt_opt.graphs.tracer.storage import ResizingStorageTracker
    from chkpt_opt.memory_model.schedule import Schedule
    from chkpt_opt.step_budget.sharding import Sharding, per_rank_graph, predicted_rank_peak_bytes
    from chkpt_opt.step_budget.whole_step import static_memory_for

    x = x.to(torch.bfloat16)
    sharding = Sharding(WORLD, master_element_bytes=4)
    graph = chkpt_opt.trace(_Stack().to(torch.bfloat16), (x,))
    rank = per_rank_graph(graph, sharding)
    static = static_memory_for(graph, "sgd", sharding=sharding)
    peaks = {}
    for name, spans in (("mixed", []), ("mixed_checkpointed", list(find_layers(rank).spans))):
        schedule = Schedule.from_spans(rank, spans)
        peaks[f"{name}_predicted"] = predicted_rank_peak_bytes(rank, schedule, sharding, static)
        model = _Stack()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for layer in model.layers:
            if spans:
                layer.__dict__["forward"] = CheckpointedForward(layer, None)
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        resident = local_bytes(list(model.parameters())) + x.untyped_storage().nbytes()
        with ResizingStorageTracker(gathered_buffers(model)) as tracker:
            model(x).backward()
        peaks[name] = resident + tracker.peak_bytes
    return peaks


def _stack_ranks(rank: int, store: str, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    import chkpt_opt
    from chkpt_opt.graphs.tracer.storage import ResizingStorageTracker
    from chkpt_opt.step_budget.sharding import Sharding

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        x = torch.randn(512, 16, generator=torch.Generator().manual_seed(rank))
        budget, original_predicted = _stack_budget_bytes(x)  # the same on both ranks
        original = _Stack()
        settings = {"budget": budget, "sharding": Sharding(WORLD), "optimizer": "sgd"}
        planned = chkpt_opt.optimize(_Stack(), (x,), **settings)  # type: ignore[arg-type]
        selective = chkpt_opt.optimize(_Stack(), (x,), selective_layers=True, **settings)  # type: ignore[arg-type]
        result: dict[str, object] = {"budget": budget, "original_predicted": original_predicted}
        for name, model in (("planned", planned), ("selective", selective)):
            result.update(layerwise_facts(name, model))
        grads = {}
        for name, model in (("original", original), ("planned", planned), ("selective", selective)):
            for layer in model.layers:
                fully_shard(layer)
            fully_shard(model)
            resident = local_bytes(list(model.parameters())) + x.untyped_storage().nbytes()
            with ResizingStorageTracker(gathered_buffers(model)) as tracker:
                model(x).backward()
            result[name] = resident + tracker.peak_bytes
            grads[name] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        result.update(_mixed_precision_peaks(x))
        torch.save(grads, os.path.join(out, f"stack{rank}.pt"))
        Path(out, f"stack{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_fsdp2_runs_a_layerwise_plan_of_a_plain_model(tmp_path: Path) -> None:
    """The same on a plain PyTorch model, fast enough for every run (a few seconds)."""
    mp.spawn(_stack_ranks, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD)
    for rank in range(WORLD):
        grads = torch.load(tmp_path / f"stack{rank}.pt")
        result = json.loads((tmp_path / f"stack{rank}.json").read_text())
        for name in ("planned", "selective"):
            assert all(torch.equal(grads[name][n], g) for n, g in grads["original"].items())
        budget = result["budget"]
        assert result["planned_layers"] and result["original"] > budget, result
        for name in ("original", "planned", "selective"):
            assert result[name] <= budget or name == "original", (name, result)
            assert close(result[f"{name}_predicted"], result[name]), (name, result)
        for name in ("mixed", "mixed_checkpointed"):  # bf16 compute, fp32 shards
            assert close(result[f"{name}_predicted"], result[name]), (name, result)
        assert result["mixed_checkpointed"] < result["mixed"], result
        # the selective policies cache what the plan keeps: less recomputed than whole layers
        assert result["selective_policies"], result["selective_summary"]
        assert result["selective_overhead"] < result["planned_overhead"], result
