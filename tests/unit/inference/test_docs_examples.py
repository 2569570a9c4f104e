"""The runnable examples of docs/inference.md run."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[3] / "docs" / "inference.md"


def test_doc_examples_run():
    blocks = re.findall(r"```python\n(# doctest: run\n.*?)```", DOC.read_text(), flags=re.S)
    assert blocks, "docs/inference.md has no runnable example"
    for code in blocks:
        exec(compile(code, str(DOC), "exec"), {})
