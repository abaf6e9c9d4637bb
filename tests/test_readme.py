"""The doctest-style examples of the README and of every page under docs/ run as written
(from the repository root)."""

from __future__ import annotations

import doctest
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]


def _doctest_blocks(page: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of every fenced python block of ``page`` written as a doctest."""
    text = page.read_text()
    blocks = []
    for match in re.finditer(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        if match.group(1).lstrip().startswith(">>>"):
            blocks.append((text.count("\n", 0, match.start()) + 1, match.group(1)))
    return blocks


def _all_blocks() -> list[tuple[Path, int, str]]:
    return [(page, line, block) for page in PAGES for line, block in _doctest_blocks(page)]


def _block_id(case: tuple[Path, int, str]) -> str:
    page, line, _ = case
    return f"{page.relative_to(ROOT)}:{line}"


def test_the_docs_have_a_units_example() -> None:
    blocks = _doctest_blocks(ROOT / "docs" / "researchers.md")
    assert any("simulate_step" in block for _, block in blocks)


def test_the_readme_is_about_one_screen() -> None:
    assert len(README.read_text().splitlines()) <= 250


@pytest.mark.parametrize("case", _all_blocks(), ids=_block_id)
def test_doc_doctest_runs(case: tuple[Path, int, str], monkeypatch: pytest.MonkeyPatch) -> None:
    page, line, block = case
    monkeypatch.chdir(ROOT)
    name = f"{page.relative_to(ROOT)}:{line}"
    test = doctest.DocTestParser().get_doctest(block, {}, name, str(page), line)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    out: list[str] = []
    runner.run(test, out=out.append)
    assert runner.failures == 0, "".join(out)
    assert os.getcwd() == str(ROOT)
