"""Fixtures of the seed-snippet tests: scripted tool-calling models and the engines on them."""

from __future__ import annotations

import pytest
import torch

from nexrl.areal import InferenceEngine
from tests.unit.agents.chatml import build_scripted_model

TIME_CALL = '{"name": "get_current_time", "arguments": {}}'
ADD_CALL = '{"name": "add", "arguments": {"a": 2, "b": 3}}'


@pytest.fixture(scope="session")
def time_model_path(tmp_path_factory):
    """Greedy reply to any chat: a Hermes call of `get_current_time`."""
    out = tmp_path_factory.mktemp("m") / "time"
    return str(build_scripted_model(out, ["<tool_call>", TIME_CALL, "</tool_call>"]))


@pytest.fixture(scope="session")
def add_model_path(tmp_path_factory):
    """Greedy reply to any chat: a Hermes call of `add(2, 3)`."""
    out = tmp_path_factory.mktemp("m") / "add"
    return str(build_scripted_model(out, ["<tool_call>", ADD_CALL, "</tool_call>"]))


def started(path: str) -> InferenceEngine:
    torch.set_num_threads(1)
    engine = InferenceEngine({"path": path, "engine": {"max_batch_size": 8}, "max_concurrent": 4})
    engine.initialize()
    return engine


@pytest.fixture(scope="module")
def time_engine(time_model_path):
    engine = started(time_model_path)
    yield engine
    engine.destroy()


@pytest.fixture(scope="module")
def add_engine(add_model_path):
    engine = started(add_model_path)
    yield engine
    engine.destroy()


@pytest.fixture
def small_overrides(tmp_path, tiny_model_path):
    """A few-second local run on the built-in task (as tests/integration/core)."""
    return [
        f"output_dir={tmp_path / 'out'}",
        f"model_path={tiny_model_path}",
        "rollout_worker.group_size=4",
        "rollout_worker.max_tokens=4",
        "rollout_worker.num_workers=2",
        "trajectory_pool.batch_size=16",
        "train_worker.total_train_steps=3",
        "train_worker.save_freq=2",
        "weight.validate_freq=0",
        "validate.validate_before_train=false",
        "validate.data.max_items=8",
        "logger.backend=[jsonl]",
    ]
