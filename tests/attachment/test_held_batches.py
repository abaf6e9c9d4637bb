"""Other batches the loop holds beside a call's own (chkpt_opt.attachment.held_batches):
found by their dtype, device, rank and batch size, each storage once, never the model's or
the call's own; a plan counts them resident."""

from __future__ import annotations

import torch
from torch import nn

import chkpt_opt
from chkpt_opt.attachment.held_batches import held_batch_bytes, holding_batches
from chkpt_opt.graphs.synthetic import chain_graph

WIDTH = 64


def test_only_tensors_that_look_like_another_batch_count() -> None:
    torch.manual_seed(0)
    model = nn.Embedding(100, WIDTH)
    ids, labels = torch.randint(0, 100, (4, 16)), torch.randint(0, 100, (4, 16))
    before = held_batch_bytes(model, ((), {"input_ids": ids, "labels": labels}))
    other = torch.randint(0, 100, (4, 16))  # another micro-batch: counted
    longer = torch.randint(0, 100, (4, 24))  # padded to another length: counted
    same_storage = other[:, :8]  # a view of a counted one: its storage once
    kept = [
        torch.randint(0, 100, (3, 16)),  # another batch size
        torch.rand(4, 16),  # another dtype
        torch.randint(0, 100, (4, 16, 2)),  # another rank
        ids[1:],  # a view of the call's own input
        torch.randint(0, 100, (4, 16)).requires_grad_(False).float().requires_grad_(),
    ]
    model.weight.grad = torch.zeros_like(model.weight)
    found = held_batch_bytes(model, ((), {"input_ids": ids, "labels": labels}))
    assert found - before == other.nbytes + longer.nbytes
    del same_storage, kept


def test_a_plan_counts_the_held_batches_resident() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)])
    x = torch.randn(32, WIDTH)

    def resident(model: nn.Module) -> int:
        chkpt_opt.optimize(model, budget=10**12, optimizer=None, profile_times=False)
        model.zero_grad(set_to_none=True)  # no gradients held: the same key each time
        model(x).sum().backward()
        (runner,) = chkpt_opt.attachment_of(model).runners
        return runner.resident_bytes

    alone = resident(net)
    chkpt_opt.detach(net)
    held = [torch.randn(32, WIDTH) for _ in range(3)]  # the step's other micro-batches
    assert resident(net) - alone == sum(t.nbytes for t in held)


def test_holding_batches_adds_to_the_inputs_of_a_copy() -> None:
    graph = chain_graph(4, activation_bytes=1000)
    graph.graph["input_bytes"] = 10
    assert holding_batches(graph, 0) is graph
    held = holding_batches(graph, 500)
    assert held.graph["input_bytes"] == 510 and held.graph["held_batch_bytes"] == 500
    assert graph.graph["input_bytes"] == 10 and "held_batch_bytes" not in graph.graph
