"""Which recompute regions replay the default random generators.

Checkpoint's ``preserve_rng_state=True`` copies the default generators' state when a region
runs forward (``torch.get_rng_state()``: 5056 bytes on CPU, kept until the region's
backward) and restores it around the recomputation, so that dropout draws the same
numbers twice. A region whose ops draw no random numbers needs neither the copy nor the
restore; Hugging Face's checkpointing pays both for every layer. Codegen asks for the
replay only where :func:`draws_random` says a region may draw, by
:func:`~chkpt_opt.graphs.tracer.ops.may_draw_random` for each op: ATen ops by their
``nondeterministic_seeded`` tag and dropout probability (attention at ``dropout_p=0``
draws nothing), and any op of a torch.fx capture that is not a plain Python function as
drawing.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.fx

from chkpt_opt.codegen.runtime import CheckpointRegion
from chkpt_opt.graphs.tracer.ops import may_draw_random


def draws_random(nodes: Iterable[torch.fx.Node], module: torch.fx.GraphModule) -> bool:
    """Whether a region of these call nodes of ``module`` may draw from the default
    generators. A region nested in it (a call of a :class:`CheckpointRegion`) counts with
    its own answer, :attr:`CheckpointRegion.replays_rng`: recomputing the outer region runs
    it forward again."""
    for node in nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if node.op == "call_module":
            called = module.get_submodule(str(node.target))
            if isinstance(called, CheckpointRegion):
                if called.replays_rng:
                    return True
                continue
        if may_draw_random(node, module):
            return True
    return False
