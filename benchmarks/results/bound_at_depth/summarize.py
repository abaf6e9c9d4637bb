"""Markdown tables from two runs of measure.py (before, after).

Run: python benchmarks/results/bound_at_depth/summarize.py before.json after.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.2f}"


def bound_table(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    lines = [
        "| graph @ budget | bound before (ms) | bound after (ms) | relative difference "
        "| rows before / after | shares equal | wall before (s) | wall after (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    worst = 0.0
    same_shares = 0
    for key, old in before["bound"].items():
        new = after["bound"][key]
        rel = 0.0
        if old["bound_s"] and new["bound_s"] is not None:
            rel = abs(old["bound_s"] - new["bound_s"]) / old["bound_s"]
        worst = max(worst, rel)
        equal = old["share_sha256"] == new["share_sha256"]
        same_shares += equal
        if key.startswith("llama") or old["wall_s"] > 0.2:
            lines.append(
                f"| {key} | {_ms(old['bound_s'])} | {_ms(new['bound_s'])} | {rel:.1e} "
                f"| {old['steps']} / {new['steps']} | {'yes' if equal else 'no'} "
                f"| {old['wall_s']:.2f} | {new['wall_s']:.2f} |"
            )
    total_old = sum(v["wall_s"] for v in before["bound"].values())
    total_new = sum(v["wall_s"] for v in after["bound"].values())
    lines.append("")
    lines.append(
        f"All {len(before['bound'])} cases: largest relative difference of the bound "
        f"{worst:.1e}; LP shares bitwise equal in {same_shares}; total wall "
        f"{total_old:.1f} s before, {total_new:.1f} s after."
    )
    return lines


def rounding_table(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    lines = [
        "| graph @ budget | bound (ms) | before: recompute (ms), s to 5% / 1% "
        "| after: recompute (ms), s to 5% / 1% |",
        "|---|---|---|---|",
    ]

    def cell(found: dict[str, Any]) -> str:
        within = found["within_s"]
        reach = " / ".join(f"{within[k]:.1f}" if k in within else "-" for k in ("0.05", "0.01"))
        return f"{_ms(found['recompute_s'])}, {reach}"

    for key, old in before["rounding"].items():
        new = after["rounding"][key]
        lines.append(f"| {key} | {_ms(new['bound_s'])} | {cell(old)} | {cell(new)} |")
    return lines


def main() -> None:
    before = json.loads(Path(sys.argv[1]).read_text())
    after = json.loads(Path(sys.argv[2]).read_text())
    print(
        f"Load (1-minute) before: {before['load_before'][0]:.2f}-{before['load_after'][0]:.2f}; "
        f"after: {after['load_before'][0]:.2f}-{after['load_after'][0]:.2f}\n"
    )
    print("\n".join(bound_table(before, after)))
    print()
    print("\n".join(rounding_table(before, after)))


if __name__ == "__main__":
    main()
