"""Memory the tracer cannot see: kernel workspace, measured on CPU with and without it.

For each model, one store-everything step is measured twice: by the storage tracker (what
the cost graph models: tensors' storages) and by the allocator's events (everything the
CPU allocator hands out, kernel-internal buffers included). The difference is the margin a
budget needs beyond the plan on that model.

    python benchmarks/workspace.py      # prints the table, writes benchmarks/results/workspace.md
"""

from __future__ import annotations

from pathlib import Path

import torch

from chkpt_opt import zoo
from chkpt_opt.measurement.step import measure_step, measure_step_allocator

MODELS = {
    "ResNet of benchmarks/peers.py": zoo.resnet,
    "tiny ResNet (8-16 channels, 32x32)": lambda: zoo.resnet(
        widths=(8, 16), blocks_per_stage=1, image=32, batch=8
    ),
    "GPT-style, 2 layers, d_model 64": lambda: zoo.gpt(
        n_layer=2, d_model=64, seq_len=64, batch=4, vocab=256
    ),
}

OUTPUT = Path(__file__).parent / "results" / "workspace.md"


def main() -> None:
    torch.set_num_threads(2)
    lines = [
        "| model | storages (bytes) | allocator (bytes) | unseen by the tracer |",
        "|---|---|---|---|",
    ]
    for name, build in MODELS.items():
        model, args, _ = build()
        torch.manual_seed(0)
        tracked = measure_step(model, args).peak_bytes
        torch.manual_seed(0)
        allocated = measure_step_allocator(model, args)
        lines.append(f"| {name} | {tracked} | {allocated} | {allocated / tracked - 1:+.1%} |")
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
