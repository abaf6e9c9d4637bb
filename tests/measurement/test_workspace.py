"""Kernel workspace measured on the device (chkpt_opt.measurement.workspace), on the CPU
with rulers that stand in for a device's allocator; the CUDA allocator itself is exercised
by tests/test_cuda.py."""

from __future__ import annotations

import pytest
import torch

import chkpt_opt
from chkpt_opt import zoo
from chkpt_opt.graphs.tracer import trace_model
from chkpt_opt.graphs.tracer.storage import StorageTracker
from chkpt_opt.measurement.workspace import StorageRuler, add_unseen_workspaces, unseen_workspaces


class _Hidden(StorageRuler):
    """Sees the tensor storages the tracer sees and ``hidden_bytes`` of scratch more in
    every op, as an allocator would with a kernel that takes scratch."""

    def __init__(self, tracker: StorageTracker, hidden_bytes: int) -> None:
        super().__init__(tracker)
        self.hidden_bytes = hidden_bytes

    def peak_bytes(self) -> int:
        return super().peak_bytes() + self.hidden_bytes


class _FirstUseLibrary(StorageRuler):
    """Takes ``kept_bytes`` in the first op it measures and keeps them, as cuBLAS keeps the
    workspace it takes on a thread's first call."""

    def __init__(self, tracker: StorageTracker, kept_bytes: int) -> None:
        super().__init__(tracker)
        self.kept_bytes = kept_bytes
        self.calls = 0

    def start(self) -> None:
        super().start()
        self.calls += 1

    def peak_bytes(self) -> int:
        return super().peak_bytes() + (self.kept_bytes if self.calls == 1 else 0)

    def live_bytes(self) -> int:
        return super().live_bytes() + (self.kept_bytes if self.calls == 1 else 0)


def _unseen(
    model: torch.nn.Module, args: tuple[torch.Tensor, ...], ruler: type[StorageRuler], *extra: int
) -> dict[str, tuple[int, int]]:
    """The unseen workspace of every op of ``model``, the allocator being a ``ruler`` over
    a tracker around the run (built with ``extra`` arguments)."""
    traced = trace_model(model, args)
    nodes = {n: bool(a["has_backward"]) for n, a in traced.graph.nodes(data=True)}
    with StorageTracker() as outer:
        found = unseen_workspaces(
            traced.captured.module,
            traced.captured.flat_inputs,
            nodes,
            allocator=lambda: ruler(outer, *extra),
        )
    assert set(found) == set(nodes)
    return found


def _mlp() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8), torch.nn.Tanh()
    )
    return model, (torch.randn(16, 32),)


@pytest.mark.parametrize(
    "build", [_mlp, lambda: zoo.gpt(n_layer=1, d_model=32, n_head=2, seq_len=8, batch=2)[:2]]
)
def test_an_allocator_that_sees_what_the_tracker_sees_adds_nothing(build) -> None:
    unseen = _unseen(*build(), StorageRuler)
    assert all(found == (0, 0) for found in unseen.values()), unseen


def test_hidden_scratch_lands_on_every_op_forward_and_on_backwards_that_run() -> None:
    model, args = _mlp()
    traced = trace_model(model, args)
    graph = traced.graph
    before = {
        n: (a["fwd_workspace_bytes"], a["bwd_workspace_bytes"]) for n, a in graph.nodes(data=True)
    }
    keep_all = chkpt_opt.simulate(graph, chkpt_opt.Schedule()).peak_bytes
    hidden = 4096
    with StorageTracker() as outer:
        add_unseen_workspaces(graph, traced.captured, allocator=lambda: _Hidden(outer, hidden))
    assert graph.graph["workspace_model"] == "measured-cpu"
    for name, attrs in graph.nodes(data=True):
        fwd, bwd = before[name]
        assert attrs["fwd_workspace_bytes"] == fwd + hidden, name
        assert attrs["bwd_workspace_bytes"] == bwd + (hidden if attrs["has_backward"] else 0), name
    assert chkpt_opt.simulate(graph, chkpt_opt.Schedule()).peak_bytes == keep_all + hidden


def test_memory_a_library_takes_once_and_keeps_is_no_op_workspace() -> None:
    unseen = _unseen(*_mlp(), _FirstUseLibrary, 32 << 20)
    assert all(found == (0, 0) for found in unseen.values()), unseen


def test_the_measuring_run_leaves_buffers_and_rng_as_they_were() -> None:
    model, args, _ = zoo.resnet(widths=(8, 16), blocks_per_stage=1, image=16, batch=4)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.random.get_rng_state()
    _unseen(model, args, StorageRuler)
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    assert torch.equal(torch.random.get_rng_state(), rng)
