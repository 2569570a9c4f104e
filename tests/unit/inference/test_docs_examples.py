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


def test_engine_options_row_lists_exactly_the_options_engines_read():
    from nexrl.inference.factory import ENGINE_OPTIONS

    row = next(x for x in DOC.read_text().splitlines() if x.startswith("| engine options |"))
    listed = row.split("|")[3].split(";")[0]
    assert set(re.findall(r"`(\w+)`", listed)) == set(ENGINE_OPTIONS)
