"""Shared by the command-line tests: the model spec, a budget, a runner, a traced graph."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chkpt_opt.cli import EXIT_OK, main

SPEC = f"{Path(__file__).parent.parent / 'cli_models.py'}:small_mlp"
BUDGET = "2MB"  # below the keep-all step peak of small_mlp (about 3.4 MB), above its minimum


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def graph_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    path = tmp_path / "mlp.json"
    code, out, _ = run(capsys, "trace", SPEC, "-o", str(path), "--json")
    assert code == EXIT_OK
    data = json.loads(out)
    assert data["nodes"] > 10 and data["keep_all_peak_bytes"] > 0
    return path
