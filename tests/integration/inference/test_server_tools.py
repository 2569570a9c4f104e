"""`tools` on nexrl's chat endpoint, driven by the official `openai` SDK.

The model is scripted (tests/unit/agents/chatml.py): its greedy reply to any chat is a
Hermes tool call, so the real server's template rendering, generation, parsing and
OpenAI `tool_calls` shaping all run, deterministically.
"""

from __future__ import annotations

import json
import socket
import sys

import httpx
import openai
import pytest

from tests.servers import spawn
from tests.unit.agents.chatml import build_scripted_model

CALL = '{"name": "add", "arguments": {"a": 2, "b": 3}}'
KEY = "tools-key"
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
ASK = [{"role": "user", "content": "what is 2+3?"}]
pytestmark = pytest.mark.slow  # one server process for the module


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    path = build_scripted_model(
        tmp_path_factory.mktemp("m") / "scripted", ["<tool_call>", CALL, "</tool_call>"]
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "nexrl.inference.serve", "--model", str(path), "--port", str(port)]
    cmd += ["--tool-call-parser", "hermes", "--threads", "1"]
    proc = spawn([*cmd, "--allow-insecure"], url)  # no key: /health must answer the spawner
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def sdk(tool_server):
    return openai.OpenAI(base_url=tool_server + "/v1", api_key="unused", max_retries=0)


def test_tool_call_comes_back_as_openai_tool_calls(sdk):
    resp = sdk.chat.completions.create(model="default", messages=ASK, tools=TOOLS, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert call.id.startswith("call_")
    # the tools were rendered into the prompt by the chat template
    raw = resp.model_dump()
    assert len(raw["prompt_token_ids"]) > 60 and raw["choices"][0]["token_ids"]


def test_tool_choice_none_returns_the_text(sdk):
    resp = sdk.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice="none", temperature=0
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == f"<tool_call>{CALL}</tool_call>"


def test_truncated_call_is_never_returned(sdk, tool_server):
    before = _parse_failures(tool_server)
    resp = sdk.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, temperature=0, max_tokens=2
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content == f"<tool_call>{CALL}"
    assert _parse_failures(tool_server) == before + 1


def test_streamed_tool_call(sdk):
    stream = sdk.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, temperature=0, stream=True
    )
    chunks = list(stream)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "tool_calls"
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "add"
    assert json.loads(calls[0].function.arguments) == {"a": 2, "b": 3}
    token_chunks = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert len(token_chunks) == 4  # one per token: the ids stream, the text waits


def test_tool_results_are_rendered_for_the_next_turn(sdk):
    first = sdk.chat.completions.create(model="default", messages=ASK, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    resp = sdk.chat.completions.create(model="default", messages=history, tools=TOOLS)
    prompt = resp.model_dump()["prompt_token_ids"]
    first_prompt = first.model_dump()["prompt_token_ids"]
    assert len(prompt) > len(first_prompt) + 10


def test_unsupported_tool_choice_and_bad_tools(sdk):
    with pytest.raises(openai.BadRequestError, match="tool_choice: 'required'"):
        sdk.chat.completions.create(
            model="default", messages=ASK, tools=TOOLS, tool_choice="required"
        )
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\]"):
        sdk.chat.completions.create(model="default", messages=ASK, tools=[{"type": "x"}])


def _parse_failures(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("nexrl_tool_call_parse_failures_total"):
            return float(line.split()[-1])
    raise AssertionError("no parse-failure metric")


def test_server_without_parser_refuses_tools(server, api_key):
    """The default server (conftest, no --tool-call-parser) says how to enable tools."""
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):
        sdk.chat.completions.create(model="default", messages=ASK, tools=TOOLS)
    ok = sdk.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=2
    )
    assert ok.choices[0].finish_reason == "length"
