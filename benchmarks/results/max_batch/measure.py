"""`chkpt_opt.bench.max_batch.max_batch_size` on the 4-layer Llama of issue 46, checked by
measuring its answer and the next batch.

Run (from the repository root):
    OMP_NUM_THREADS=1 python benchmarks/results/max_batch/measure.py

Model and budget as ``benchmarks/max_length.py`` builds them (``--layers 4 --mode full
--batch 2 --ref-len 512``): a Hugging Face Llama of 4 layers (hidden 256, vocabulary 2048,
random weights), full fine-tuning with AdamW; budget = the measured whole-step peak of HF
checkpointing at 2 x 512 tokens. The search traces each batch on fake tensors (estimated op
times) and asks ``auto`` for any schedule that fits, for a loop that drops the logits before
the backward pass (``outputs_held=False``, as max_length's probes plan); then the answer and
the next batch are planned with ``chkpt_opt.plan`` (60 s) and measured by a real step
(``max_length.Bench.probe``), and HF checkpointing's largest batch is found the same way,
for reference.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))
import max_length  # noqa: E402

from chkpt_opt.bench.max_batch import max_batch_size  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    args = max_length.main_parser().parse_args(
        ["--layers", "4", "--mode", "full", "--batch", "2", "--time-limit", "60"]
    )
    base = max_length.build(4, "full", seed=0)
    reference = max_length.Bench(base, 1 << 60, args)
    budget = reference.probe("hf_checkpointing", 2, 512).peak_bytes
    assert budget is not None

    def build(batch: int):  # type: ignore[no-untyped-def]
        data = max_length.make_batch(batch, 512, 0)
        return copy.deepcopy(base), (), {**data.inputs, "use_cache": False}

    start = time.perf_counter()
    found = max_batch_size(build, budget, max_batch=64, outputs_held=False)
    search_s = time.perf_counter() - start
    bench = max_length.Bench(base, budget, args)
    answer = found.with_plan
    measured = {b: bench.probe("chkpt_opt", b, 512) for b in (answer, answer + 1)}
    hf = max_length.largest(lambda b: bench.probe("hf_checkpointing", b, 512).fits, 1, 1, 64)
    row = {
        "budget_bytes": budget,
        "search_s": round(search_s, 1),
        "with_plan": answer,
        "without_checkpointing": found.without_checkpointing,
        "proven_infeasible": list(found.proven_infeasible),
        "next_batch": found.next_batch,
        "measured": {
            b: {"fits": p.fits, "peak_bytes": p.peak_bytes, "note": p.note}
            for b, p in measured.items()
        },
        "hf_checkpointing_largest": hf,
    }
    print(json.dumps(row, indent=1, default=str))
    (Path(__file__).parent / "measure.json").write_text(json.dumps(row, indent=1, default=str))


if __name__ == "__main__":
    main()
