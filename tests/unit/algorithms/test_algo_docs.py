"""docs/algorithms.md lists every registered name, and its examples run."""

import inspect
import re
from pathlib import Path

import pytest

from nexrl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    compute_loss,
)

DOC = Path(__file__).resolve().parents[3] / "docs" / "algorithms.md"
REGISTRIES = [ADVANTAGE_ESTIMATORS, POLICY_LOSSES, AGGREGATIONS, KL_ESTIMATORS]


def doc_text() -> str:
    return DOC.read_text()


def table_names(text: str) -> set[str]:
    """Names in the first column of every markdown table row: | `name` | ..."""
    return set(re.findall(r"^\|\s*`([^`]+)`\s*\|", text, flags=re.M))


@pytest.mark.parametrize("registry", REGISTRIES, ids=lambda r: r.kind)
def test_every_registered_name_has_a_table_row(registry):
    missing = set(registry.names()) - table_names(doc_text())
    assert not missing, f"docs/algorithms.md lacks rows for {registry.kind}s {sorted(missing)}"


def test_every_compute_loss_kwarg_is_documented():
    params = inspect.signature(compute_loss).parameters
    documented = set(re.findall(r"`?(\w+)`?\s*\(", doc_text())) | set(
        re.findall(r"(\w+)=", doc_text())
    )
    skip = {"logprobs", "batch", "loss_kwargs"}
    missing = {p for p in params if p not in skip} - documented
    assert not missing, f"compute_loss kwargs not in the doc: {sorted(missing)}"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_doc_examples_run():
    blocks = python_blocks(doc_text())
    assert len(blocks) == 2
    exec(compile(blocks[0], str(DOC), "exec"), {})
    try:
        namespace: dict = {}
        exec(compile(blocks[1], str(DOC), "exec"), namespace)
        assert POLICY_LOSSES.get("my_reinforce") is namespace["my_reinforce"]
    finally:
        POLICY_LOSSES._items.pop("my_reinforce", None)
