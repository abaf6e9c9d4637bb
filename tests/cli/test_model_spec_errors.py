"""A model function that raises: exit 4 and one line naming the spec, the error and the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from chkpt_opt.cli import EXIT_TRACE
from tests.cli.conftest import run

RAISES = f"{Path(__file__).parent.parent / 'cli_models.py'}:raises"


def assert_one_clear_line(err: str) -> None:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("chkpt-opt: ") and RAISES in line, line
    assert "RuntimeError: boom" in line, line
    assert "check that raises(" in line and "(model, example_args" in line, line


@pytest.mark.parametrize(
    "argv",
    [
        ("trace", RAISES, "-o", "unused.json"),
        ("optimize", RAISES, "--budget", "1GB"),
        ("validate", RAISES, "--budget", "1GB"),
        ("max-batch", RAISES, "--budget", "1GB"),
    ],
    ids=lambda argv: argv[0],
)
def test_model_function_that_raises_exits_4(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]
) -> None:
    code, _, err = run(capsys, *argv)
    assert code == EXIT_TRACE
    assert_one_clear_line(err)
    if argv[0] == "max-batch":
        assert "raises(batch=" in err, err


def test_console_script_prints_no_traceback(tmp_path: Path) -> None:
    """The real process: exit status 4 and nothing on stderr but the one line."""
    result = subprocess.run(
        [sys.executable, "-m", "chkpt_opt.cli", "trace", RAISES, "-o", str(tmp_path / "x.json")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == EXIT_TRACE, result.stderr
    assert_one_clear_line(result.stderr)
    assert not (tmp_path / "x.json").exists()
