"""Cost graphs of Hugging Face models on a padded batch, with measured op times, as files.

Run:
    python benchmarks/hf_graphs.py                    # llama and bert into tests/data/hf_padded
    python benchmarks/hf_graphs.py --families t5 -o /tmp/graphs

Each family of :mod:`chkpt_opt.zoo.huggingface` (4 layers of width 256, from its config with
random weights, a batch of 4 x 256 tokens whose last 48 positions are masked and ignored by
the loss, as ``benchmarks/padded.py`` builds it) is traced with ``profile_times=True`` on
this machine's CPU; the graph goes to ``<family>.json`` and the peak of the same step under
``gradient_checkpointing_enable()`` (bytes above the resident ones, the storage tracker's
exact peak) to ``budgets.json``: the budget at which plans meet the model's own
checkpointing. The solver tests read them (``tests/solvers/test_auto_contract.py``), so
solvers are checked on the graphs people plan, with no model traced at test time. Op times
differ between machines and runs; the files are a fixed sample of them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from hf_models import hf_checkpointed, log, tracked_peak
from padded import batch_of

import chkpt_opt
from chkpt_opt.graphs.io import save_graph

SIZES = {"layers": 4, "width": 256, "batch": 4, "seq": 256}
PADDED = 48


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=["llama", "bert"])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("-o", "--output", type=Path, default=Path("tests/data/hf_padded"))
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    options.output.mkdir(parents=True, exist_ok=True)
    budgets_path = options.output / "budgets.json"
    budgets = json.loads(budgets_path.read_text()) if budgets_path.exists() else {}
    for family in options.families:
        torch.manual_seed(0)
        model, args = batch_of(family, SIZES, PADDED)
        keep_all = chkpt_opt.plan(
            model, args, budget=10**15, optimizer=None, solver="keep_all", profile_times=True
        )
        save_graph(keep_all.graph, options.output / f"{family}.json")
        budgets[family] = tracked_peak(hf_checkpointed(model), args)
        log(f"{family}: {keep_all.graph.number_of_nodes()} ops, HF peak {budgets[family]} B")
    budgets_path.write_text(json.dumps(budgets, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
