from __future__ import annotations

import pytest
import torch

from nexrl.config import load_config
from nexrl.inference.engine import Engine
from tests.unit.agents.chatml import build_scripted_model

CALL = '{"name": "add", "arguments": {"a": 2, "b": 3}}'
WORKFLOW = "tests.integration.agents.workflows:TwoTurnWorkflow"


@pytest.fixture
def agent_config(tmp_path, tiny_model_path):
    """A few-second local run on the built-in task with `rollout_worker.type=agent`."""

    def make(*extra: str):
        return load_config(
            [
                f"output_dir={tmp_path / 'out'}",
                f"model_path={tiny_model_path}",
                "rollout_worker.type=agent",
                f"rollout_worker.workflow={WORKFLOW}",
                "rollout_worker.group_size=4",
                "rollout_worker.max_tokens=4",
                "rollout_worker.num_workers=3",
                "trajectory_pool.batch_size=8",
                "train_worker.total_train_steps=3",
                "train_worker.save_freq=0",
                "weight.validate_freq=0",
                "validate.validate_before_train=false",
                "validate.data.max_items=4",
                "logger.backend=[jsonl]",
                *extra,
            ]
        )

    return make


@pytest.fixture(autouse=True)
def _fresh_engines():
    """Each run gets its own in-process engine (they are shared per model tag)."""
    from nexrl.inference.client import shutdown_local_engines

    shutdown_local_engines()
    yield
    shutdown_local_engines()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """A scripted model whose greedy reply to any chat is a Hermes call of `add`."""
    out = tmp_path_factory.mktemp("m") / "scripted"
    return str(build_scripted_model(out, ["<tool_call>", CALL, "</tool_call>"]))


@pytest.fixture(scope="module")
def engine(model_path):
    torch.set_num_threads(1)
    eng = Engine(model_path, max_batch_size=8)
    yield eng
    eng.shutdown()
