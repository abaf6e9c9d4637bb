"""FSDP2 (``fully_shard`` per decoder layer and at the root) over a model with a layer-wise
plan attached: the parameters and gradients of FSDP2 over the original (gloo, two CPU
processes), every rank's measured peak within its per-rank budget, and the predicted
per-rank peak (FSDP2's buffers placed in time) within 3% of the measured one, with the plan
and without."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.attachment.rank_memory import (
    close,
    gathered_buffers,
    layerwise_facts,
    local_bytes,
)
from tests.attachment.tiny_models import tiny_llama

transformers = pytest.importorskip("transformers")

VOCAB = 256
WORLD = 2
BATCH, SEQ = 4, 64
STEPS = 2


def _model() -> torch.nn.Module:
    return tiny_llama(vocab=VOCAB, layers=4, intermediate=128, max_positions=SEQ)


def _budget_bytes() -> tuple[int, int]:
    """Halfway between every layer checkpointed and none, for one rank (the FSDP2 buffers
    counted as the budget split's upper bound), and the predicted peak without a plan of
    the loop below (which drops the logits before the backward pass)."""
    import chkpt_opt
    from chkpt_opt.attachment.held_outputs import dropping_outputs
    from chkpt_opt.export.layers import find_layers
    from chkpt_opt.memory_model.schedule import Schedule
    from chkpt_opt.step_budget.sharding import Sharding, per_rank_graph, predicted_rank_peak_bytes
    from chkpt_opt.step_budget.whole_step import static_memory_for

    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    graph = chkpt_opt.trace(_model(), (), {"input_ids": ids, "labels": ids, "use_cache": False})
    sharding = Sharding(world_size=WORLD)
    rank = per_rank_graph(graph, sharding)
    every = Schedule.from_spans(rank, list(find_layers(rank).spans))
    low = chkpt_opt.simulate(rank, every).peak_bytes
    high = chkpt_opt.simulate(rank, Schedule.from_spans(rank, [])).peak_bytes
    static = static_memory_for(graph, "adamw", sharding=sharding)
    dropped = per_rank_graph(dropping_outputs(graph), sharding)
    original = predicted_rank_peak_bytes(dropped, Schedule(), sharding, static)
    return static.resident_bytes + (low + high) // 2, original


def _ranks_steps(rank: int, store: str, out: str, budget: int) -> None:
    from torch.distributed.fsdp import fully_shard

    import chkpt_opt
    from chkpt_opt.graphs.tracer.storage import ResizingStorageTracker
    from chkpt_opt.step_budget.sharding import Sharding

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        gen = torch.Generator().manual_seed(10 + rank)
        batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]
        original = _model()
        contenders = {"original": original}
        result: dict[str, object] = {}
        for name, selective in (("planned", False), ("selective", True)):
            contenders[name] = chkpt_opt.optimize(  # before fully_shard: plain tensors
                copy.deepcopy(original),
                budget=budget,
                sharding=Sharding(world_size=WORLD),
                example_kwargs={"input_ids": batches[0], "labels": batches[0]},
                time_limit_s=2,
                profile_times=False,
                outputs_held=False,  # the loop below keeps the loss alone
                selective_layers=selective,
            )
            result.update(layerwise_facts(name, contenders[name]))
        states = {}
        for name, model in contenders.items():
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
            peaks = []
            grads = []
            for ids in batches:
                optimizer.zero_grad(set_to_none=True)
                resident = local_bytes(list(model.parameters()))
                resident += local_bytes([v for s in optimizer.state.values() for v in s.values()])
                with ResizingStorageTracker(gathered_buffers(model)) as tracker:
                    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                    grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
                    optimizer.step()
                peaks.append(resident + ids.untyped_storage().nbytes() + tracker.peak_bytes)
            params = {n: p.full_tensor() for n, p in model.named_parameters()}
            states[name] = (grads, params)
            result[f"{name}_peaks"] = peaks
        torch.save(states, os.path.join(out, f"rank{rank}.pt"))
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # about 18 s on 2 cores: two processes, each tracing and planning
def test_fsdp2_over_a_layerwise_plan_equals_fsdp2_within_the_rank_budget(tmp_path: Path) -> None:
    budget, original_predicted = _budget_bytes()
    mp.spawn(_ranks_steps, args=(str(tmp_path / "store"), str(tmp_path), budget), nprocs=WORLD)
    for rank in range(WORLD):
        states = torch.load(tmp_path / f"rank{rank}.pt")
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        grads, params = states["original"]
        for name in ("planned", "selective"):
            got_grads, got_params = states[name]
            for got, want in zip(got_grads, grads, strict=True):
                assert all(torch.equal(got[n], want[n]) for n in want), (name, rank)
            assert all(torch.equal(got_params[n], params[n]) for n in params), (name, rank)
            # the budget needs checkpointed layers
            assert result[f"{name}_layers"], result[f"{name}_summary"]
            measured = max(result[f"{name}_peaks"])
            assert measured <= budget, (name, result, budget)
            assert close(result[f"{name}_predicted"], measured), (name, result)
        original = max(result["original_peaks"])
        assert original > budget, (result, budget)
        assert close(original_predicted, original), (result, original_predicted)
        # the selective policies cache what the plan keeps: less recomputed than whole layers
        assert result["selective_policies"], result["selective_summary"]
        assert result["selective_overhead"] < result["planned_overhead"], result
