"""Host memory by planning stage and over the first steps, for plan_cost.md's Run 4.

Run (from the repository root):
    OMP_NUM_THREADS=1 python benchmarks/results/plan_cost_rss.py

The 32-layer Llama of ``benchmarks/plan_cost.py`` (no HF copy in the process), planned by
``chkpt_opt.optimize`` at HF checkpointing's measured peak (551,361,492 bytes, Run 3's
budget) for a loop that drops the logits; prints ``VmHWM``/``VmRSS`` of
``/proc/self/status`` after each planning stage and after each of 5 steps, with the bytes
of the real tensor storages alive then (found through the garbage collector), and last
after detaching the plan. With ``MALLOC_MMAP_THRESHOLD_=131072`` in the environment, glibc
returns freed blocks at once (``plan_cost_rss_mmap_threshold.txt``).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import plan_cost

import chkpt_opt

BUDGET_BYTES = 551_361_492


def memory() -> str:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmHWM", "VmRSS")):
            name, value = line.split(":", 1)
            fields[name] = value.strip()
    return str(fields)


def live_tensor_mib() -> float:
    sizes = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            try:
                storage = obj.untyped_storage()
                sizes[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # a fake tensor the capture kept: no storage
                continue
    return sum(sizes.values()) / 2**20


class Stages(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "finished" in message:
            print(f"{message[:48]:48} {memory()}", flush=True)


def main() -> None:
    logger = logging.getLogger("chkpt_opt")
    logger.addHandler(Stages())
    logger.setLevel(logging.INFO)
    model, batch = plan_cost._setup(32)
    print(f"{'base':48} {memory()}")
    chkpt_opt.optimize(model, budget=BUDGET_BYTES, outputs_held=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(5):
        plan_cost._step(model, optimizer, batch)
        print(f"{f'after step {step + 1}':48} {memory()} live tensors {live_tensor_mib():.1f} MiB")
    # What the attachment holds: its plans and captures, freed by detaching (glibc asked to
    # return what it keeps, so that the resident set shows it).
    chkpt_opt.detach(model)
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    print(f"{'after detaching the plan':48} {memory()} live tensors {live_tensor_mib():.1f} MiB")


if __name__ == "__main__":
    main()
