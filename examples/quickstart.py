"""Quickstart: plan, rewrite, train and validate the GPT-style reference model under a budget.

Run:  python examples/quickstart.py [--budget 200MB]

It prints the budget (GB and GiB), how it splits, the predicted and the measured peak, the
gradient check and the step-time ratio measured side by side.
"""

from __future__ import annotations

import argparse

import torch

import chkpt_opt
from chkpt_opt import zoo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budget", default="200MB", help='whole-step budget, e.g. "200MB", "0.2GiB"'
    )
    parser.add_argument("--optimizer", default="adamw", help="adamw, sgd, ... or none")
    args = parser.parse_args()
    torch.set_num_threads(2)

    # 8 layers, d_model 256, 4 heads, sequence 256, batch 8 (plain PyTorch, random weights).
    model, inputs, _kwargs = zoo.gpt()
    optimizer = None if args.optimizer == "none" else args.optimizer

    plan = chkpt_opt.plan(model, inputs, budget=args.budget, optimizer=optimizer)
    print(plan.summary())

    optimized = plan.apply()  # shares model's parameters: train it like the model
    report = chkpt_opt.validate(
        model, optimized, inputs, predicted_peak_bytes=plan.profile.peak_bytes
    )
    print(report.summary())
    measured_total = plan.static.resident_bytes + report.measured_peak_bytes
    print(
        f"whole step: budget {chkpt_opt.format_bytes(plan.budget.total_bytes)}, "
        f"predicted {chkpt_opt.format_bytes(plan.predicted_peak_bytes)}, "
        f"measured {chkpt_opt.format_bytes(measured_total)} "
        f"({'within' if measured_total <= plan.budget.total_bytes else 'OVER'} budget)"
    )

    # An ordinary training loop on the optimized module.
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for step in range(2):
        opt.zero_grad()
        loss = optimized(*inputs)
        loss.backward()
        opt.step()
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
