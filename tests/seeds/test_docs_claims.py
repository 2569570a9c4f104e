"""Claims in the prose of docs/*.md checked against the code: defaults stated in running
text ("`key` (default X)", "`key` defaults to X", "(N s by default"), which the key-table
test of tests/test_docs.py does not read, and the four sentences an audit found false."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from nexrl.config import load_config
from nexrl.config.reference import schema_defaults
from nexrl.config.schema import TrajectoryPoolConfig

DOCS = Path(__file__).parents[2] / "docs"
KEY = r"`([a-z_]+(?:\.[a-z_]+)+)`"
CLAIMS = [
    re.compile(KEY + r",? \(?default:? `?([\w.\-]+)`?"),
    re.compile(KEY + r" defaults to `([^`]+)`"),
    re.compile(KEY + r"(?: set)? \(([\d.]+) s by default"),
]


def prose_claims() -> list[tuple[str, str, str]]:
    out = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        for pattern in CLAIMS:
            out += [(page.name, key, value) for key, value in pattern.findall(text)]
    return out


def same(text: str, expected: object) -> bool:
    value = yaml.safe_load(text)
    if isinstance(expected, float) and isinstance(value, int | float):
        return float(value) == expected
    return value == expected or str(value) == str(expected)


def test_defaults_stated_in_prose_are_the_schemas():
    defaults = schema_defaults()
    claims = [(p, k, v) for p, k, v in prose_claims() if k in defaults]
    assert len(claims) >= 5  # the patterns still find the pages' claims
    wrong = [
        f"{p}: {k} says {v!r}, code {defaults[k]!r}"
        for p, k, v in claims
        if not same(v, defaults[k])
    ]
    assert not wrong, "; ".join(wrong)


class RecordingWorker:
    """A `rollout_worker.type=module:Class` that keeps what it was constructed with."""

    def __init__(self, *args: object) -> None:
        self.args = args


def test_custom_worker_construction_as_documented():
    text = (DOCS / "rollout.md").read_text()
    assert "`Class(config, llm_client, context, reward_fn)`" in text
    from nexrl.builders import build_rollout_worker
    from nexrl.inference.client import LLMServiceClient, shutdown_local_engines
    from nexrl.rewards import get_reward_fn
    from nexrl.rollout.base import RolloutContext

    cfg = load_config([f"rollout_worker.type={__name__}:RecordingWorker"])
    try:
        worker = build_rollout_worker(cfg)
        assert isinstance(worker, RecordingWorker)
        config, client, context, reward_fn = worker.args
        assert config.type == cfg.rollout_worker.type and config.group_size == 16
        assert isinstance(client, LLMServiceClient) and isinstance(context, RolloutContext)
        assert reward_fn is get_reward_fn(cfg.rollout_worker.reward_fn)
    finally:
        shutdown_local_engines()


def test_pool_group_size_default_from_python_as_documented():
    assert TrajectoryPoolConfig().group_size == 16
    assert "has the same default, 16" in (DOCS / "pools.md").read_text()


def test_logger_backend_forms_as_documented():
    assert "`logger.backend=jsonl,wandb`" in (DOCS / "monitoring.md").read_text()
    assert list(load_config(["logger.backend=jsonl,console"]).logger.backend) == [
        "jsonl",
        "console",
    ]


def test_version_is_the_train_step_as_documented():
    text = (DOCS / "architecture.md").read_text()
    assert "`version` is the train step whose weights the inference side serves" in text
    assert (
        "version becomes\n    the train step"
        in (DOCS.parent / "nexrl/config/schema.py").read_text()
    )
