"""Generate the configuration reference (docs/configuration.md) from the schema.

Field docs are the string literals under each dataclass field, read with
`ast`, so the schema stays the single source of truth:

    python -m nexrl.config.reference > docs/configuration.md
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from typing import Any

from nexrl.config import schema


def field_docs(cls: type) -> dict[str, str]:
    """{field name: docstring} for a dataclass whose fields carry string docs."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        named = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        if named and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        return None if dataclasses.is_dataclass(value) else value
    return None


def _rows(cls: type, prefix: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            nested.append((kind, f"{prefix}{f.name}."))
            continue
        default = _default(f)
        shown = "null" if default is None else repr(default)
        rows.append(f"| `{prefix}{f.name}` | `{shown}` | {docs.get(f.name, '')} |")
    for kind, sub in nested:
        rows.extend(_rows(kind, sub))
    return rows


def render() -> str:
    head = [
        "# Configuration reference",
        "",
        "Generated from `nexrl/config/schema.py` by `python -m nexrl.config.reference`;",
        "a test fails when this page and the schema disagree. Values below are the schema",
        "defaults; `nexrl/config/rl_train.yaml` sets the embedded default run on top of them.",
        "Override any key on the command line: `nexrl train train_worker.total_train_steps=20`.",
        "Keys inside free-form dicts (`loss_kwargs`, `advantage_kwargs`) take a `+`:",
        "`nexrl train +algorithm.loss_kwargs.kl_coef=0.1`.",
        "",
        "| key | default | meaning |",
        "| --- | --- | --- |",
    ]
    return "\n".join(head + _rows(schema.RLTrainConfig, "")) + "\n"


if __name__ == "__main__":
    print(render(), end="")
