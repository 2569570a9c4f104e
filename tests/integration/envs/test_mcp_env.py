"""MCPToolingEnv against a real MCP server (the SDK's MCPServer) over stdio and HTTP."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("mcp")

from nexrl.envs import MCPToolingEnv, ToolingEnv  # noqa: E402

SERVER = str(Path(__file__).with_name("mcp_calc_server.py"))
pytestmark = pytest.mark.slow  # each test starts a Python MCP server process


async def _exercise(env: MCPToolingEnv) -> None:
    assert isinstance(env, ToolingEnv)
    tools = {t["function"]["name"]: t["function"] for t in await env.list_tools()}
    assert set(tools) == {"add", "fail", "sleep", "echo"}
    assert tools["add"]["parameters"]["required"] == ["a", "b"]
    assert tools["add"]["description"] == "Add two integers."
    assert (await env.call_tool("add", {"a": 2, "b": 40})).content == "42"
    res = await env.call_tool("fail", {"message": "boom"})
    assert res.is_error and "boom" in res.content
    res = await env.call_tool("add", {"a": "x", "b": 1})
    assert res.is_error
    assert (await env.call_tool("nope", {})).is_error
    res = await env.call_tool("echo", {"text": "y" * 50})
    assert res.truncated and res.content.startswith("y" * 20) and "truncated 30" in res.content
    res = await env.call_tool("sleep", {"seconds": 8})
    assert res.is_error and "timed out" in res.content
    assert (await env.call_tool("add", {"a": 1, "b": 1})).content == "2"  # still usable
    m = env.metrics.as_dict()
    assert (m["tools/calls"], m["tools/failures"], m["tools/timeouts"]) == (7, 4, 1)


def test_stdio_transport():
    async def main():
        cmd = [sys.executable, SERVER, "stdio"]
        async with MCPToolingEnv(cmd, timeout_s=3, max_output_chars=20) as env:
            await _exercise(env)

    asyncio.run(main())


@pytest.fixture
def http_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, SERVER, "http", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/mcp"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(url, timeout=1)
            break
        except httpx.TransportError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("MCP HTTP server did not start") from None
            time.sleep(0.2)
    yield url
    proc.terminate()  # uvicorn waits for the sleeping tool's thread; do not wait for it
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_streamable_http_transport(http_server):
    async def main():
        async with MCPToolingEnv(http_server, timeout_s=3, max_output_chars=20) as env:
            await _exercise(env)

    asyncio.run(main())


def test_bad_stdio_command():
    with pytest.raises(ValueError, match="empty"):
        MCPToolingEnv([])


def test_a_session_opened_by_one_episode_closes_from_another_task():
    """Episodes (tasks) share the session; the close comes from yet another task and the
    server process goes away, without anyio's cancel-scope error."""

    async def main():
        env = MCPToolingEnv([sys.executable, SERVER, "stdio"], timeout_s=10)

        async def episode(a: int) -> str:
            return (await env.call_tool("add", {"a": a, "b": 1})).content

        assert await asyncio.gather(*(asyncio.create_task(episode(i)) for i in range(3))) == [
            "1",
            "2",
            "3",
        ]
        await asyncio.create_task(env.aclose())
        await env.aclose()  # twice is fine

    asyncio.run(main())


def test_a_server_that_cannot_start_fails_the_call_that_opened_it():
    async def main():
        env = MCPToolingEnv([sys.executable, "-c", "import sys; sys.exit(3)"], timeout_s=5)
        with pytest.raises(BaseException):  # noqa: B017 (the SDK's own error type)
            await asyncio.wait_for(env.list_tools(), 30)
        await env.aclose()

    asyncio.run(main())
