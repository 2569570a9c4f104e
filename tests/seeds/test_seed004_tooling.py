"""Seed 004's "Environment" section: the ToolingEnv methods on the local and MCP envs."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from nexrl.areal import LocalToolingEnv, MCPToolingEnvConfig, ToolingEnv

SERVER = str(Path(__file__).parents[1] / "integration" / "envs" / "mcp_calc_server.py")


def forecast(city: str, days: int = 1, metric: bool = True) -> str:
    """The weather in a city."""
    return f"{city}: sunny for {days} day(s)"


def test_local_env_has_the_seed_methods():
    env = LocalToolingEnv()
    assert isinstance(env, ToolingEnv) and env.is_initialized
    asyncio.run(env.ainitialize())
    env.register_tool(forecast)
    with pytest.raises(ValueError, match="already registered"):
        env.register_tool(forecast)
    with pytest.raises(TypeError):
        env.register_tool("not a function")  # type: ignore[arg-type]
    # the seed's schema: docstring description, JSON types, required = no default
    fn = LocalToolingEnv.generate_schema(forecast)["function"]
    assert fn["name"] == "forecast" and fn["description"] == "The weather in a city."
    props = fn["parameters"]["properties"]
    assert {k: v["type"] for k, v in props.items()} == {
        "city": "string",
        "days": "integer",
        "metric": "boolean",
    }
    assert fn["parameters"]["required"] == ["city"]
    assert env.list_tools() == env.tool_schemas == [LocalToolingEnv.generate_schema(forecast)]
    assert env.tool_registry == {"forecast": forecast}

    async def calls():
        ok = await env.aexecute("forecast", {"city": "Oslo", "days": 2})
        unknown = await env.aexecute("nope", {})
        bad = await env.aexecute("forecast", {"days": 2})
        await env.aclose()
        return ok, unknown, bad

    ok, unknown, bad = asyncio.run(calls())
    assert ok == "Oslo: sunny for 2 day(s)"
    assert "unknown tool 'nope'" in unknown  # errors come back as text, never raised
    assert "city" in bad and "invalid arguments" in bad


@pytest.mark.slow  # starts a Python MCP server process
def test_mcp_env_from_the_seed_config():
    from nexrl.areal import MCPToolingEnv

    async def main():
        env = MCPToolingEnv(MCPToolingEnvConfig(command=[sys.executable, SERVER, "stdio"]))
        assert not env.is_initialized
        await env.ainitialize()
        try:
            names = [t["function"]["name"] for t in env.list_tools()]  # no await after init
            assert {"add", "fail"} <= set(names) and env.is_initialized
            assert await env.aexecute("add", {"a": 2, "b": 40}) == "42"
            assert await env.tool_registry["add"](a=1, b=2) == "3"
            assert "boom" in await env.aexecute("fail", {"message": "boom"})
        finally:
            await env.aclose()
        assert not env.is_initialized  # closed: the session is gone

    asyncio.run(main())
    with pytest.raises(ValueError, match="exactly one of `url` and `command`"):
        MCPToolingEnv(MCPToolingEnvConfig())
