"""LocalToolingEnv: schemas from signatures, validation, errors as results, limits, metrics."""

from __future__ import annotations

import asyncio
import time
from typing import Literal

import pytest

from nexrl.envs import LocalToolingEnv, ToolingEnv, run_tool_calls
from nexrl.inference.tool_parsers import get_parser


def add(a: int, b: int = 2) -> int:
    """Add two integers.

    Longer explanation that is not part of the description.

    Args:
        a: The first
            operand.
        b (int): The second operand.
    """
    return a + b


async def search(query: str, mode: Literal["web", "news"] = "web", k: list[int] | None = None):
    """Search for something."""
    await asyncio.sleep(0)
    return {"query": query, "mode": mode, "k": k}


def run(coro):
    return asyncio.run(coro)


def test_schema_from_signature_and_docstring():
    env = LocalToolingEnv([add, search])
    assert isinstance(env, ToolingEnv)
    add_schema, search_schema = run(env.list_tools())
    fn = add_schema["function"]
    assert fn["name"] == "add" and fn["description"] == "Add two integers."
    props = fn["parameters"]["properties"]
    assert props["a"] == {"type": "integer", "description": "The first operand."}
    assert props["b"]["default"] == 2 and props["b"]["description"] == "The second operand."
    assert fn["parameters"]["required"] == ["a"]
    mode = search_schema["function"]["parameters"]["properties"]["mode"]
    assert mode["enum"] == ["web", "news"]


def test_sync_and_async_calls():
    env = LocalToolingEnv([add, search])
    assert run(env.call_tool("add", {"a": 3})).content == "5"
    res = run(env.call_tool("search", {"query": "q", "k": [1]}))
    assert not res.is_error and '"k": [1]' in res.content


@pytest.mark.parametrize(
    ("name", "args", "expected"),
    [
        ("add", {"a": "x"}, "a: Input should be a valid integer"),
        ("add", {}, "a: Field required"),
        ("add", {"a": 1, "c": 2}, "c: Extra inputs are not permitted"),
        ("search", {"query": "q", "mode": "tv"}, "mode: Input should be 'web' or 'news'"),
        ("mul", {}, "unknown tool 'mul'"),
    ],
)
def test_bad_calls_come_back_as_errors(name, args, expected):
    env = LocalToolingEnv([add, search])
    res = run(env.call_tool(name, args))
    assert res.is_error and expected in res.content
    assert env.metrics.failures == 1 and env.metrics.calls == 1


def test_exception_timeout_and_truncation():
    def boom() -> str:
        """Fails."""
        raise RuntimeError("disk on fire")

    async def slow() -> str:
        """Too slow."""
        await asyncio.sleep(5)
        return "late"

    def big() -> str:
        """Long output."""
        return "x" * 100

    env = LocalToolingEnv([boom, slow, big], timeout_s=0.2, max_output_chars=10)
    res = run(env.call_tool("boom", {}))
    assert res.is_error and "RuntimeError: disk on fire" in res.content
    res = run(env.call_tool("slow", {}))
    assert res.is_error and "timed out after 0.2s" in res.content
    res = run(env.call_tool("big", {}))
    assert res.content.startswith("x" * 10) and "truncated 90 characters" in res.content
    m = env.metrics.as_dict()
    assert (m["tools/calls"], m["tools/failures"], m["tools/timeouts"]) == (3, 2, 1)
    assert m["tools/truncated"] == 1 and m["tools/max_latency_s"] > 0


def test_sync_tools_run_off_the_event_loop():
    def blocking() -> str:
        """Blocks its thread."""
        time.sleep(0.3)
        return "done"

    env = LocalToolingEnv([blocking])

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        res = await env.call_tool("blocking", {})
        task.cancel()
        return res, ticks

    res, ticks = run(main())
    assert res.content == "done" and ticks > 3  # the loop kept running meanwhile


def test_registration_is_per_instance_and_checked():
    a, b = LocalToolingEnv(), LocalToolingEnv()
    a.register_tool(add)
    assert run(b.list_tools()) == []
    with pytest.raises(ValueError, match="already registered"):
        a.register_tool(add)

    def untyped(x):
        return x

    with pytest.raises(TypeError, match="'x' needs a type hint"):
        a.register_tool(untyped)


def test_run_tool_calls_executes_parsed_calls_and_counts_failures():
    env = LocalToolingEnv([add])
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call><tool_call>{bad</tool_call>'
    )
    _, calls, failures = get_parser("hermes").parse(text)
    msgs = run(run_tool_calls(env, calls, failures))
    assert [m["content"] for m in msgs] == ["2", "4"]
    assert [m["tool_call_id"] for m in msgs] == [c.id for c in calls]
    assert env.metrics.parse_failures == 1 and env.metrics.calls == 2
