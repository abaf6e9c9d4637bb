"""The chkpt-opt entry point: ``python -m chkpt_opt.cli`` and the top-level help."""

from __future__ import annotations

import subprocess
import sys


def test_console_script_help_lists_examples() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "chkpt_opt.cli", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0
    assert "examples:" in result.stdout and "exit codes" in result.stdout
