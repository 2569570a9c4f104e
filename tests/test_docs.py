"""The docs are checked against the code.

- Every python block marked `# doctest: run` is executed, page by page; every other
  python block must at least compile.
- Every yaml block is a config fragment (or a recipe with `defaults:`) whose keys the
  schema declares; a recipe is composed with the real loader.
- Every `nexrl ...` line in a bash block names a real command; `nexrl train` lines are
  composed with the CLI's own config check (`--cfg`, nothing runs).
- `docs/configuration.md` is exactly what `python -m nexrl.config.reference` prints, and
  every `| \\`key\\` | \\`default\\` |` row of a key table shows the schema default (or,
  where the row says so, the packaged `rl_train.yaml` value).
- Every backticked dotted config key (`weight.validate_freq`) names a real key.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from nexrl.config.reference import render, schema_defaults
from nexrl.config.suggest import free_form_parent, schema_keys, unknown_keys

DOCS = Path(__file__).resolve().parents[1] / "docs"
BLOCK = re.compile(r"```python\n(# doctest: run.*?)```", re.S)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
CHECKED = [
    "agents",
    "algorithms",
    "architecture",
    "async",
    "configuration",
    "dashboard",
    "data",
    "inference",
    "models",
    "monitoring",
    "performance",
    "pools",
    "quickstart",
    "ray",
    "reliability",
    "rewards",
    "rollout",
    "training",
    "weight_sync",
]
"""Pages whose blocks, tables and keys are checked (add a page once it passes)."""
SECTIONS = {k for k in schema_keys() if "." not in k}


def runnable_blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


def blocks(page: Path, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(page.read_text()) if lang == language]


PAGES = [p for p in sorted(DOCS.glob("*.md")) if runnable_blocks(p)]
CHECKED_PAGES = [DOCS / f"{name}.md" for name in CHECKED]


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_docs_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for i, block in enumerate(runnable_blocks(page)):
        code = compile(block, f"{page.name}[block {i}]", "exec")
        exec(code, namespace)  # noqa: S102 - the docs are ours


def test_every_capability_page_has_a_runnable_example():
    assert len(PAGES) >= 6, [p.name for p in PAGES]


@pytest.mark.parametrize("page", CHECKED_PAGES, ids=CHECKED)
def test_python_blocks_compile(page):
    for i, block in enumerate(blocks(page, "python")):
        compile(block, f"{page.name}[python block {i}]", "exec")


@pytest.mark.parametrize("page", CHECKED_PAGES, ids=CHECKED)
def test_yaml_blocks_are_valid_config(page, tmp_path):
    from nexrl.config import load_config

    for i, block in enumerate(blocks(page, "yaml")):
        data = yaml.safe_load(block)
        assert isinstance(data, dict), f"{page.name} yaml block {i}: not a mapping"
        if "defaults" in data:  # a recipe: compose it with the real loader
            (tmp_path / f"recipe_{i}.yaml").write_text(block)
            load_config([], f"recipe_{i}", tmp_path)
        else:
            assert unknown_keys(data) == [], f"{page.name} yaml block {i}"


def _nexrl_commands(block: str) -> list[list[str]]:
    """Each `nexrl ...` command of a bash block as argv (continuations joined)."""
    text = block.replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        for part in re.split(r"&&|;|\|", line.split("#", 1)[0]):
            words = shlex.split(part)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value nexrl ...
                words = words[1:]
            if words and words[0] == "nexrl":
                commands.append(words[1:])
    return commands


@pytest.mark.parametrize("page", CHECKED_PAGES, ids=CHECKED)
def test_bash_nexrl_commands_name_real_commands_and_keys(page, capsys):
    from nexrl.cli import COMMANDS, check_engine_overrides, main

    for block in blocks(page, "bash"):
        for argv in _nexrl_commands(block):
            assert argv and argv[0] in COMMANDS, f"{page.name}: nexrl {' '.join(argv)}"
            if argv[0] in ("sft", "train-service"):
                assert check_engine_overrides(argv[0], argv[1:]) is None, argv
            if argv[0] != "train" or any(a.startswith("--config") for a in argv):
                continue
            rc = main(["train", "--log-level", "ERROR", "--cfg", *argv[1:]])
            err = capsys.readouterr().err
            assert rc == 0, f"{page.name}: nexrl {' '.join(argv)}: {err}"


def test_configuration_page_is_generated_from_the_schema():
    assert (DOCS / "configuration.md").read_text() == render(), (
        "docs/configuration.md is stale: python -m nexrl.config.reference > docs/configuration.md"
    )


ROW = re.compile(r"^\|\s*(`[^|]*`)\s*\|\s*([^|]*?)\s*\|", re.M)
TICKS = re.compile(r"`([^`]+)`")


def _expand(cells: list[str]) -> list[str]:
    """`rollout_worker.temperature`, `top_p` -> both full keys (the first sets the section)."""
    if not cells or "." not in cells[0]:
        return cells
    section = cells[0].rsplit(".", 1)[0]
    return [cells[0]] + [c if "." in c else f"{section}.{c}" for c in cells[1:]]


def _same(text: str, value: Any) -> bool:
    try:
        shown = yaml.safe_load(text)
    except yaml.YAMLError:
        return False
    if isinstance(shown, str) and isinstance(value, float):
        try:
            shown = float(shown)  # yaml 1.1 reads `1e-8` as a string
        except ValueError:
            return False
    if isinstance(value, tuple):
        value = list(value)
    return shown == value or (isinstance(value, float) and shown == pytest.approx(value))


@pytest.mark.parametrize("page", CHECKED_PAGES, ids=CHECKED)
def test_key_tables_show_the_real_defaults(page):
    from omegaconf import OmegaConf

    from nexrl.config import load_config

    defaults = schema_defaults()
    packaged = OmegaConf.to_container(load_config([]))
    wrong = []
    for key_cell, value_cell in ROW.findall(page.read_text()):
        keys = _expand(TICKS.findall(key_cell))
        values = TICKS.findall(value_cell)
        if not keys or not all(k in defaults for k in keys) or len(values) != len(keys):
            continue
        for key, text in zip(keys, values, strict=True):
            if "rl_train.yaml" in value_cell:
                node: Any = packaged
                for part in key.split("."):
                    node = node[part]
                expected = node
            else:
                expected = defaults[key]
            if not _same(text, expected):
                wrong.append(f"{key}: page says {text!r}, code says {expected!r}")
    assert not wrong, f"{page.name}: " + "; ".join(wrong)


@pytest.mark.parametrize("page", CHECKED_PAGES, ids=CHECKED)
def test_dotted_config_keys_in_text_exist(page):
    known = set(schema_keys())
    bad = []
    for token in TICKS.findall(page.read_text()):
        token = token.split("=", 1)[0].lstrip("+").strip()
        if not re.fullmatch(r"[a-z_]+(\.[a-z_0-9]+)+", token):
            continue
        if token.split(".")[0] not in SECTIONS:
            continue
        if token not in known and free_form_parent(token) is None:
            bad.append(token)
    for token in re.findall(r"config key `([^`]+)`", page.read_text()):
        if token not in known:
            bad.append(token)
    assert not bad, f"{page.name}: unknown config keys {sorted(set(bad))}"
