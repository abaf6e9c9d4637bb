"""Lowering a schedule to per-layer settings, for trainers that only take those.

Many trainers can checkpoint whole transformer layers and nothing finer: Hugging Face
(``gradient_checkpointing`` on every layer, or on every n-th), torchtitan (a per-block
``full``/``none`` choice) and Megatron-LM (``--recompute-granularity full`` with the
``uniform`` or ``block`` method and a number of layers). A lowering picks the layers to
checkpoint, expresses them in the target's vocabulary, and reports the predicted peak and
extra compute of the lowered schedule beside the exact one, so the user sees what the
target loses. Whole-layer checkpointing is itself a keep-set schedule (one region per
layer), so the simulator evaluates the lowering exactly.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from chkpt_opt.errors import ScheduleError
from chkpt_opt.graphs.costgraph import CostGraph, ordered_nodes
from chkpt_opt.memory_model.schedule import Schedule, cut_positions
from chkpt_opt.memory_model.simulate import simulate

_INDEXED = re.compile(r"^(?P<container>.+?)\.(?P<index>\d+)(?:\.|$)")


@dataclass(frozen=True)
class Layers:
    """The repeated layers of a graph.

    Attributes:
        container: module path of the layer container (``"blocks"``, ``"transformer.h"``).
        spans: ``[start, stop)`` op-index span of every layer, in layer order.
    """

    container: str
    spans: tuple[tuple[int, int], ...]


def find_layers(graph: CostGraph) -> Layers:
    """Finds the container whose indexed children hold the most ops, and each child's span.

    Raises:
        ValueError: when the graph has no indexed layers whose spans are contiguous and
            can be cut (e.g. a model without a layer container).
    """
    order = ordered_nodes(graph)
    counts: Counter[str] = Counter()
    for node in order:
        match = _INDEXED.match(graph.nodes[node]["module_path"])
        if match:
            counts[match.group("container")] += 1
    ok = cut_positions(graph)
    for container, _ in counts.most_common():
        members: dict[int, list[int]] = {}
        for node in order:
            path = graph.nodes[node]["module_path"]
            prefix = container + "."
            if path.startswith(prefix):
                head = path[len(prefix) :].split(".", 1)[0]
                if head.isdigit():
                    members.setdefault(int(head), []).append(graph.nodes[node]["index"])
        if len(members) < 2:
            continue
        spans = []
        for layer in sorted(members):
            idx = members[layer]
            start, stop = min(idx), max(idx) + 1
            spans.append((start, stop))
        disjoint = all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
        if disjoint and all(ok[a] and ok[b] for a, b in spans):
            return Layers(container=container, spans=tuple(spans))
    raise ValueError(
        "no repeated layers found (ops with module paths like 'blocks.3...'); per-layer "
        "settings need a model built from a list of layers."
    )


@dataclass(frozen=True)
class Lowering:
    """A schedule expressed for a target, with what the translation costs.

    Attributes:
        target: ``"huggingface"``, ``"torchtitan"`` or ``"megatron"``.
        settings: the target's configuration.
        layers: the layers checkpointed (indices into the container).
        schedule: the lowered schedule (one region per checkpointed layer).
        exact_peak_bytes: simulated peak of the schedule that was lowered.
        lowered_peak_bytes: simulated peak of the lowered schedule.
        exact_overhead: extra compute of the exact schedule (fraction of the step).
        lowered_overhead: extra compute of the lowered schedule.
        notes: what the target cannot express.
        budget_bytes: the forward/backward (activation) budget the lowering was asked to
            fit, or None when none was given.
    """

    target: str
    settings: dict[str, Any]
    layers: tuple[int, ...]
    schedule: Schedule
    exact_peak_bytes: int
    lowered_peak_bytes: int
    exact_overhead: float
    lowered_overhead: float
    notes: tuple[str, ...] = field(default_factory=tuple)
    budget_bytes: int | None = None

    @property
    def over_budget_bytes(self) -> int:
        """How far the lowered peak exceeds the budget (0 when it fits or none was given)."""
        if self.budget_bytes is None:
            return 0
        return max(self.lowered_peak_bytes - self.budget_bytes, 0)

    @property
    def meets_budget(self) -> bool:
        """Whether the lowered schedule fits the budget (True when none was given).

        Per-layer settings cannot express every schedule: a schedule that fits its budget
        may lower to one that does not even with every layer checkpointed. The exact
        schedule still runs through :meth:`chkpt_opt.api.Plan.apply`.
        """
        return self.over_budget_bytes == 0

    @property
    def exact(self) -> bool:
        """Whether the lowered schedule is the exact one."""
        return (
            self.lowered_peak_bytes == self.exact_peak_bytes
            and abs(self.lowered_overhead - self.exact_overhead) < 1e-12
        )


def refuse_staged(schedule: Schedule, lowering: str) -> None:
    """Raises where ``schedule`` is staged: no lowering expresses ops recomputed just before
    chosen backward ops."""
    if schedule.staged:
        raise ScheduleError(
            f"this schedule is staged (ops recomputed just before chosen backward ops), which "
            f"{lowering} cannot express. Run it eagerly (plan.apply()), or lower a plan solved "
            "without staging."
        )


def choose_layers(
    graph: CostGraph, schedule: Schedule, *, budget_bytes: int | None = None
) -> tuple[Layers, tuple[int, ...]]:
    """The layers to checkpoint whole to stand for ``schedule``.

    A layer is checkpointed when the schedule recomputes at least half of its forward time.
    With a budget, more layers are added (the ones saving the most memory per second of
    recomputation first) until the lowered schedule fits, if it can.
    """
    refuse_staged(schedule, "a per-layer checkpointing setting")
    layers = find_layers(graph)
    order = ordered_nodes(graph)
    recomputed = schedule.recomputed_nodes()
    chosen = []
    for k, (start, stop) in enumerate(layers.spans):
        total = sum(graph.nodes[n]["fwd_time_s"] for n in order[start:stop])
        redo = sum(graph.nodes[n]["fwd_time_s"] for n in order[start:stop] if n in recomputed)
        if total > 0 and redo >= 0.5 * total:
            chosen.append(k)
    if budget_bytes is not None:
        while True:
            current = Schedule.from_spans(graph, [layers.spans[k] for k in chosen])
            peak = simulate(graph, current, check=False).peak_bytes
            if peak <= budget_bytes:
                break
            rest = [k for k in range(len(layers.spans)) if k not in chosen]
            if not rest:
                break
            best = min(
                rest,
                key=lambda k: (
                    simulate(
                        graph,
                        Schedule.from_spans(graph, [layers.spans[j] for j in sorted([*chosen, k])]),
                        check=False,
                    ).peak_bytes,
                    k,
                ),
            )
            chosen = sorted([*chosen, best])
    return layers, tuple(chosen)


def _every_n(chosen: tuple[int, ...], n_layers: int) -> int | None:
    """``n`` when ``chosen`` is every n-th layer starting at 0, else None."""
    if not chosen:
        return None
    for n in range(1, n_layers + 1):
        if tuple(range(0, n_layers, n)) == chosen:
            return n
    return None


def lower_to_layers(
    graph: CostGraph,
    schedule: Schedule,
    *,
    target: str,
    budget_bytes: int | None = None,
) -> Lowering:
    """Lowers ``schedule`` to per-layer settings of ``target``.

    Args:
        graph: the cost graph.
        schedule: the exact schedule.
        target: ``"huggingface"``, ``"torchtitan"`` or ``"megatron"``.
        budget_bytes: if given, layers are added until the lowered peak fits it; when even
            every layer checkpointed does not fit, the result says so
            (:attr:`Lowering.meets_budget` is False) and the caller decides.

    Example:
        >>> lowering = lower_to_layers(graph, plan.schedule, target="huggingface")  # doctest: +SKIP
        >>> lowering.lowered_peak_bytes, lowering.exact_peak_bytes  # doctest: +SKIP
    """
    if target not in ("huggingface", "torchtitan", "megatron"):
        raise ValueError(
            f"target {target!r} is unknown; use 'huggingface', 'torchtitan' or 'megatron'."
        )
    layers, chosen = choose_layers(graph, schedule, budget_bytes=budget_bytes)
    n = len(layers.spans)
    lowered = Schedule.from_spans(graph, [layers.spans[k] for k in chosen])
    exact_profile = simulate(graph, schedule)
    lowered_profile = simulate(graph, lowered)
    notes: list[str] = []
    if not schedule.is_keep_set():
        notes.append(
            "nested regions, cached and unpacked ops have no per-layer setting; the lowering "
            "recomputes whole layers"
        )
    recomputed_outside = schedule.recomputed_nodes() - set(
        name
        for k in range(n)
        for name in ordered_nodes(graph)[layers.spans[k][0] : layers.spans[k][1]]
    )
    if recomputed_outside:
        notes.append(
            f"{len(recomputed_outside)} recomputed ops lie outside the layers "
            "(embeddings, head) and are kept"
        )
    order = ordered_nodes(graph)
    recomputed = schedule.recomputed_nodes()
    partial = []
    for k, (start, stop) in enumerate(layers.spans):
        inside = sum(1 for name in order[start:stop] if name in recomputed)
        if 0 < inside < stop - start:
            partial.append(k)
    if partial:
        notes.append(
            f"layers {partial} were recomputed in part; the lowering keeps or recomputes them whole"
        )
    settings: dict[str, Any]
    if target == "huggingface":
        every = _every_n(chosen, n)
        settings = {"gradient_checkpointing": bool(chosen)}
        if every is not None and every > 1:
            settings["every_n_layers"] = every
        elif chosen and len(chosen) < n:
            settings["checkpoint_layers"] = list(chosen)
    elif target == "torchtitan":
        settings = {
            "activation_checkpoint": {
                "mode": "none" if not chosen else ("full" if len(chosen) == n else "selective"),
                "per_block": {str(k): ("full" if k in chosen else "none") for k in range(n)},
            }
        }
        every = _every_n(chosen, n)
        if every is not None and every > 1:
            settings["activation_checkpoint"]["selective_ac_option"] = str(every)
    else:
        if not chosen:
            settings = {"recompute_granularity": None}
        elif chosen == tuple(range(len(chosen))):
            settings = {
                "recompute_granularity": "full",
                "recompute_method": "block",
                "recompute_num_layers": len(chosen),
            }
        else:
            # Megatron's "uniform" checkpoints the input of each group of num_layers layers;
            # the nearest uniform grouping that covers the chosen layers is every layer.
            settings = {
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": 1,
            }
            notes.append(
                "Megatron cannot checkpoint an arbitrary set of layers; all layers are recomputed"
            )
            chosen = tuple(range(n))
            lowered = Schedule.from_spans(graph, list(layers.spans))
            lowered_profile = simulate(graph, lowered)
        settings["flags"] = _megatron_flags(settings)
    return Lowering(
        target=target,
        settings=settings,
        layers=chosen,
        schedule=lowered,
        exact_peak_bytes=exact_profile.peak_bytes,
        lowered_peak_bytes=lowered_profile.peak_bytes,
        exact_overhead=exact_profile.overhead,
        lowered_overhead=lowered_profile.overhead,
        notes=tuple(notes),
        budget_bytes=budget_bytes,
    )


def _megatron_flags(settings: dict[str, Any]) -> list[str]:
    if not settings.get("recompute_granularity"):
        return []
    return [
        f"--recompute-granularity={settings['recompute_granularity']}",
        f"--recompute-method={settings['recompute_method']}",
        f"--recompute-num-layers={settings['recompute_num_layers']}",
    ]
