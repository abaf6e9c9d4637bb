"""The README's doctest-style examples run as written (from the repository root)."""

from __future__ import annotations

import doctest
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def _doctest_blocks() -> list[tuple[int, str]]:
    """``(line, text)`` of every fenced python block of the README written as a doctest."""
    text = README.read_text()
    blocks = []
    for match in re.finditer(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        if match.group(1).lstrip().startswith(">>>"):
            blocks.append((text.count("\n", 0, match.start()) + 1, match.group(1)))
    return blocks


def test_the_readme_has_a_units_example() -> None:
    assert any("simulate_step" in block for _, block in _doctest_blocks())


@pytest.mark.parametrize("line, block", _doctest_blocks(), ids=lambda v: str(v)[:12])
def test_readme_doctest_runs(line: int, block: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    test = doctest.DocTestParser().get_doctest(block, {}, f"README.md:{line}", str(README), line)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    out: list[str] = []
    runner.run(test, out=out.append)
    assert runner.failures == 0, "".join(out)
    assert os.getcwd() == str(ROOT)
