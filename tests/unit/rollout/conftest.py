from __future__ import annotations

import pytest
import torch

from nexrl.inference.engine import Engine
from tests.unit.agents.chatml import build_scripted_model

CALL = '{"name": "add", "arguments": {"a": 2, "b": 3}}'


@pytest.fixture(scope="session")
def tool_model_path(tmp_path_factory):
    """A scripted model whose greedy reply to any chat is a Hermes call of `add`."""
    out = tmp_path_factory.mktemp("m") / "scripted"
    return str(build_scripted_model(out, ["<tool_call>", CALL, "</tool_call>"]))


@pytest.fixture(scope="module")
def tool_engine(tool_model_path):
    torch.set_num_threads(1)
    eng = Engine(tool_model_path, max_batch_size=8)
    yield eng
    eng.shutdown()
