"""DistributedDataParallel over a model with a plan attached gives the gradients of DDP over
the original (gloo, two CPU processes, batches of other lengths on each rank)."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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
    finally:
        dist.destroy_process_group()


def test_ddp_gradients_equal_ddp_over_the_original(tmp_path: Path) -> None:
    mp.spawn(_ranks_steps, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD)
    for rank in range(WORLD):
        grads = torch.load(tmp_path / f"rank{rank}.pt")
        for planned, original in zip(grads["planned"], grads["original"], strict=True):
            assert planned.keys() == original.keys()
            assert all(torch.equal(planned[n], original[n]) for n in original), rank
