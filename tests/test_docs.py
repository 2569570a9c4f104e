"""Every docs example marked `# doctest: run` is executed, page by page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
BLOCK = re.compile(r"```python\n(# doctest: run.*?)```", re.S)


def runnable_blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


PAGES = [p for p in sorted(DOCS.glob("*.md")) if runnable_blocks(p)]


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_docs_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for i, block in enumerate(runnable_blocks(page)):
        code = compile(block, f"{page.name}[block {i}]", "exec")
        exec(code, namespace)  # noqa: S102 - the docs are ours


def test_every_capability_page_has_a_runnable_example():
    assert len(PAGES) >= 6, [p.name for p in PAGES]
