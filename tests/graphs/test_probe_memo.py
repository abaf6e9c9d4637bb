"""The cost graph built with the probe memo is the one built probing every op."""

from __future__ import annotations

import networkx as nx
import pytest
import torch

from chkpt_opt.graphs.tracer import probe_memo, trace_model
from chkpt_opt.graphs.tracer.probe import LeafInfo
from chkpt_opt.graphs.tracer.probe_memo import ProbeMemo, probe_key


def _graphs_equal(a: nx.DiGraph, b: nx.DiGraph) -> None:
    assert list(a.nodes) == list(b.nodes)
    assert sorted(a.edges) == sorted(b.edges)
    for name in a.nodes:
        assert a.nodes[name] == b.nodes[name], name
    assert a.graph == b.graph


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_llama_built_with_the_memo_is_the_graph_built_probing_every_op(
    dynamic: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    from chkpt_opt.zoo.huggingface import llama

    model, args, kwargs = llama(layers=3, width=64, batch=2, seq=16)
    counts: list[tuple[int, int]] = []
    original = ProbeMemo.probe

    def counted(self: ProbeMemo, *a: object, **k: object) -> object:
        out = original(self, *a, **k)  # type: ignore[arg-type]
        counts.append((self.probes, self.hits))
        return out

    monkeypatch.setattr(ProbeMemo, "probe", counted)
    memoized = trace_model(model, args, kwargs, method="export", dynamic=dynamic).graph
    probes, hits = counts[-1]
    assert hits > probes  # three identical layers: most ops probed before
    monkeypatch.setattr(probe_memo, "probe_key", lambda *a, **k: None)
    every = trace_model(model, args, kwargs, method="export", dynamic=dynamic).graph
    _graphs_equal(memoized, every)


def test_the_key_tells_apart_what_the_probe_reads() -> None:
    op = torch.ops.aten.mm.default
    a, b = torch.empty(4, 8), torch.empty(8, 2)
    plain = [LeafInfo(True), LeafInfo(True, param="w0")]

    def key(
        *args: object, infos: list[LeafInfo] = plain, first: frozenset[str] = frozenset()
    ) -> object:
        return probe_key(op, args, {}, infos, True, (True,), set(first))

    base = key(a, b)
    assert base is not None and key(torch.empty(4, 8), torch.empty(8, 2)) == base
    assert key(a, torch.empty(8, 3)) != base  # sizes
    assert key(a, torch.empty(2, 8).t()) != base  # strides
    assert key(a.to(torch.bfloat16), b) != base  # dtype
    assert key(a, b, infos=[LeafInfo(True), LeafInfo(True, param="w1")]) == base
    assert key(a, b, infos=[LeafInfo(False), LeafInfo(True, param="w0")]) != base
    assert key(a, b, first=frozenset({"w0"})) != base  # the gradient created here first
    assert probe_key(op, (a, b), {}, plain, False, (True,), set()) != base  # grad mode
    assert probe_key(lambda x, y: x @ y, (a, b), {}, plain, True, (True,), set()) is None
    assert probe_key(op, (a, object()), {}, plain[:1], True, (True,), set()) is None
