"""Generate the configuration reference (docs/configuration.md) from the schema.

Field docs are the string literals under each dataclass field, read with
`ast`, so the schema stays the single source of truth:

    python -m nexrl.config.reference > docs/configuration.md
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import typing
from typing import TYPE_CHECKING

import yaml

from nexrl.config import options, schema

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


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


def show(value: object) -> str:
    """A default as you would write it in yaml or on the command line: `null`, `true`,
    `sync`, `[jsonl, console]`, `{}`; `yaml.safe_load` of the text gives the value back."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value and yaml.safe_load(value) == value else json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {show(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _rows(section: DataclassInstance, prefix: str) -> list[str]:
    """Rows for one section *instance*, so a section built by a `default_factory` with
    its own values (`validate.data` is a `DataConfig` with `split="validation"`,
    `shuffle=False`, `num_epochs=1`) shows those, not the class defaults."""
    cls = type(section)
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        value = getattr(section, f.name)
        nested_section = dataclasses.is_dataclass(value) and not isinstance(value, type)
        if dataclasses.is_dataclass(hints[f.name]) and nested_section:
            nested.append((value, f"{prefix}{f.name}."))
            continue
        rows.append(f"| `{prefix}{f.name}` | `{show(value)}` | {docs.get(f.name, '')} |")
    for value, sub in nested:
        rows.extend(_rows(value, sub))
    return rows


def schema_defaults() -> dict[str, object]:
    """{dotted key: schema default} for every leaf key, as the page shows them."""
    out: dict[str, object] = {}

    def walk(section: DataclassInstance, prefix: str) -> None:
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                walk(value, f"{prefix}{f.name}.")
            else:
                out[prefix + f.name] = value

    walk(schema.RLTrainConfig(), "")
    for section, (cls, _) in OPTION_TABLES.items():
        out.update({f"{section}.{k}": v for k, v in dataclasses.asdict(cls()).items()})
    return out


OPTION_TABLES: dict[str, tuple[type, str]] = {
    "service.inference_service.engine": (
        options.InferenceEngineConfig,
        """Options of the `builtin` engine (`hf` reads `dtype`, `device` and `max_model_len`;
`vllm` takes its own, docs/inference.md), from `nexrl.config.options.InferenceEngineConfig`:
the defaults of `Engine` and `nexrl serve` too. The section is a mapping, so an option
the packaged `rl_train.yaml` does not set is added with a `+`
(`+service.inference_service.engine.threads=2`); `max_batch_size`, which it sets (256),
takes none. An unknown option or a value of the wrong type fails naming the key.""",
    ),
    "ray.groups.<group>": (
        options.RayGroupConfig,
        "The Ray options of a colocation group's actor, from "
        "`nexrl.config.options.RayGroupConfig` (docs/ray.md); `ray.groups` is a mapping, so "
        "an entry is added with a `+` (`+ray.groups.train.num_cpus=2`).",
    ),
}
"""Typed option sets shown in tables of their own: {key prefix: (dataclass, intro)}."""


HEAD = """# Configuration reference

Generated from `nexrl/config/schema.py` by `python -m nexrl.config.reference`;
a test fails when this page and the schema disagree. Values below are the schema
defaults; `nexrl/config/rl_train.yaml` sets the embedded default run on top of them
(`nexrl train --cfg` prints the composed result).

## Setting keys

On the command line (Hydra override syntax), any number of `key=value`:

```bash
nexrl train train_worker.total_train_steps=20 rollout_worker.group_size=4
nexrl train --cfg trajectory_pool.batch_size=64
```

`--cfg` (or `--print-config`) prints the composed config and exits without
training. A key the schema does not declare fails before anything runs, naming
the closest real keys (`unknown config key 'train_worker.totl_train_steps'; did
you mean 'train_worker.total_train_steps'?`), with or without a leading `+`.
Only inside the free-form dicts (`algorithm.loss_kwargs`,
`algorithm.advantage_kwargs`, `service.inference_service.engine`, `ray.*` maps) a
new key takes a `+`: `nexrl train +algorithm.loss_kwargs.kl_coef=0.1`.

## Your own recipe

A recipe is a yaml file in any folder that starts from the packaged default and
sets what differs:

```yaml
defaults: [rl_train, _self_]
experiment_name: my_recipe
rollout_worker:
  group_size: 8
trajectory_pool:
  batch_size: 64
weight:
  sync_mode: fully-async
  staleness_threshold: 1
```

```bash
nexrl train --config-dir recipes --config-name my_recipe seed=1
nexrl train --config-name recipes/my_recipe.yaml --cfg
```

`--config-dir DIR --config-name NAME` reads `DIR/NAME.yaml`; a `--config-name`
that ends in `.yaml` is a path. Command-line keys apply on top of the recipe.
Unknown keys in the file fail the same way as on the command line.

## Every key
"""


def render() -> str:
    head = [
        HEAD,
        "| key | default | meaning |",
        "| --- | --- | --- |",
    ]
    lines = head + _rows(schema.RLTrainConfig(), "")
    for section, (cls, intro) in OPTION_TABLES.items():
        lines += ["", f"## `{section}`", "", intro, "", *head[1:], *_rows(cls(), f"{section}.")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
