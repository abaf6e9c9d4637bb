"""The predicted memory timeline in the format of PyTorch's memory snapshot viewer.

``torch.cuda.memory._dump_snapshot`` writes a pickled dict whose ``device_traces`` list
every allocation and free of the caching allocator; https://pytorch.org/memory_viz and
``torch.cuda._memory_viz`` draw it. :func:`predicted_snapshot` writes the simulator's
timeline in the same form (one trace entry per storage created or freed, each labelled
with its op and step), so a user can open the prediction and a real snapshot of the same
step in the same tool and compare them.

The file is written with ``pickle`` because that is what the viewer reads; chkpt_opt never
loads pickle files itself.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from chkpt_opt.graphs.costgraph import CostGraph
from chkpt_opt.memory_model.op_sequence import lower
from chkpt_opt.memory_model.schedule import Schedule

_ALIGN = 512


def predicted_snapshot(graph: CostGraph, schedule: Schedule, *, device: int = 0) -> dict[str, Any]:
    """The simulated step as a memory snapshot dict (``segments`` and ``device_traces``)."""
    traces: list[dict[str, Any]] = []
    addresses: dict[str, tuple[int, int]] = {}
    next_address = 0

    def frame(kind: str, node: str, what: str) -> list[dict[str, Any]]:
        path = graph.nodes[node]["module_path"] if node in graph else ""
        return [{"filename": path or "<model>", "line": 0, "name": f"{kind} {node}: {what}"}]

    for position, step in enumerate(lower(graph, schedule)):
        for inst, nbytes in step.alloc:
            size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
            addresses[inst] = (next_address, size)
            traces.append(
                {
                    "action": "alloc",
                    "addr": next_address,
                    "size": size,
                    "stream": 0,
                    "time_us": position,
                    "frames": frame(step.kind, step.node, inst),
                }
            )
            next_address += size
        if step.transient_bytes:
            size = -(-step.transient_bytes // _ALIGN) * _ALIGN
            for action in ("alloc", "free_requested", "free_completed"):
                traces.append(
                    {
                        "action": action,
                        "addr": next_address,
                        "size": size,
                        "stream": 0,
                        "time_us": position,
                        "frames": frame(step.kind, step.node, "workspace"),
                    }
                )
            next_address += size
        for inst in step.free:
            addr, size = addresses.pop(inst)
            for action in ("free_requested", "free_completed"):
                traces.append(
                    {
                        "action": action,
                        "addr": addr,
                        "size": size,
                        "stream": 0,
                        "time_us": position,
                        "frames": frame(step.kind, step.node, inst),
                    }
                )
    return {
        "segments": [],
        "device_traces": [traces if d == device else [] for d in range(device + 1)],
    }


def save_predicted_snapshot(path: str | Path, graph: CostGraph, schedule: Schedule) -> Path:
    """Writes :func:`predicted_snapshot` as a pickle file the memory viewer opens."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:
        pickle.dump(predicted_snapshot(graph, schedule), handle)
    return path
