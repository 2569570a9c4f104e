"""The workflow executor against a real `nexrl serve` app (RemoteBackend), and
`LLMServiceClient.generate(messages, tools=...)` on both backends.

The model is scripted (tests/unit/agents/chatml.py): its greedy reply to any chat is a
Hermes call of `add`, so tool calls come back deterministically.
"""

from __future__ import annotations

import pytest

from nexrl.agents.workflows import ToolWorkflow
from nexrl.inference.client import LLMServiceClient
from nexrl.inference.remote import RemoteBackend
from nexrl.inference.server import create_app
from nexrl.rollout.workflow import WorkflowExecutor
from tests.integration.inference.conftest import ServerThread

KEY = "agents-key"
ASK = [{"role": "user", "content": "what is 2+3?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture(scope="module")
def server(engine):
    app = create_app(engine, api_key=KEY, tool_parser="hermes")
    with ServerThread(app) as srv:
        yield srv


def remote_config(server, model_path) -> dict:
    return {"backend": "remote", "url": server.url, "api_key": KEY, "model": model_path}


def test_executor_on_a_remote_engine_is_token_exact(server, model_path, engine):
    remote = RemoteBackend(remote_config(server, model_path))
    ex = WorkflowExecutor(remote)
    try:
        assert ex.check_health()
        workflow = ToolWorkflow(tools=[add], max_turns=2, max_tokens=16, temperature=0.0)
        (t,) = ex.rollout([{"uid": 0, "prompt": "what is 2+3?"}], workflow)
    finally:
        ex.shutdown()
    mask = t["loss_mask"]
    assert sum(mask) == 8 and mask[0] == 1 and mask[-1] == 1 and 0 in mask
    tool_part = [i for i, m in zip(t["response_ids"], mask, strict=True) if not m]
    assert "<tool_response>\n5\n</tool_response>" in engine.tokenizer.decode(tool_part)
    assert t["agent_metrics"]["agent/tool_calls"] == 1


@pytest.mark.parametrize("backend", ["builtin", "remote"])
def test_generate_returns_openai_tool_calls(backend, server, model_path, engine):
    if backend == "builtin":
        client = LLMServiceClient({"backend": "builtin", "model": model_path}, engine=engine)
    else:
        client = LLMServiceClient(remote_config(server, model_path))
    result = client.generate(ASK, tools=TOOLS, max_tokens=16, temperature=0.0)
    (call,) = result["tool_calls"]
    assert call["type"] == "function" and call["id"]
    assert call["function"]["name"] == "add"
    assert call["function"]["arguments"] == '{"a": 2, "b": 3}'
    assert result["finish_reason"] == "tool_calls"
    assert result["response_ids"] and len(result["response_logprobs"]) == len(
        result["response_ids"]
    )
    plain = client.generate(ASK, max_tokens=16, temperature=0.0)  # no tools: text only
    assert plain["tool_calls"] == [] and "<tool_call>" in plain["response"]
