"""`MCPToolingEnv`: the tools of a Model Context Protocol server.

Uses the official `mcp` SDK (2.x, `pip install nexrl[agents]`) as a client over
either transport the SDK speaks: stdio (the env launches the server command as
a subprocess) or streamable HTTP (a URL). The MCP tool listing maps directly
onto OpenAI tool schemas (`inputSchema` is a JSON schema). Tool errors
(`isError`), transport errors and timeouts come back to the model as error
results, as with `LocalToolingEnv`.

The SDK's client lives in an anyio task scope, which must be entered and left in
one task. The env therefore holds the session in a task of its own: `connect`
starts that task (on the running loop) and waits until the session is open;
`aclose` asks it to leave and waits. Episodes on other tasks share the session,
and any task of the same loop may close it (`async with MCPToolingEnv(...) as
env:` still works).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

from nexrl.envs.base import (
    CallLimits,
    MCPToolingEnvConfig,
    ToolList,
    ToolMetrics,
    ToolResult,
    ToolSchema,
    aexecute,
    guarded_call,
)

if TYPE_CHECKING:
    from mcp import StdioServerParameters
    from mcp.types import CallToolResult


def _import_mcp():
    try:
        import mcp
    except ImportError as exc:  # the extra is optional
        raise ImportError("MCPToolingEnv needs the MCP SDK: pip install 'nexrl[agents]'") from exc
    return mcp


class MCPToolingEnv:
    """Tools served by an MCP server.

    server: a streamable-HTTP URL (`http://127.0.0.1:8000/mcp`), or a command to launch over
        stdio as a list (`["python", "server.py"]`), or an `mcp.StdioServerParameters`, or
        seed 004's `MCPToolingEnvConfig` (its limits then replace the keyword ones).
    timeout_s / max_output_chars: per-call limits (see `nexrl.envs.base.CallLimits`).
    """

    def __init__(
        self,
        server: str | list[str] | MCPToolingEnvConfig | StdioServerParameters,
        *,
        env: dict[str, str] | None = None,
        timeout_s: float | None = 30.0,
        max_output_chars: int = 8192,
    ) -> None:
        mcp = _import_mcp()
        if isinstance(server, MCPToolingEnvConfig):
            timeout_s, max_output_chars, env = server.timeout_s, server.max_output_chars, server.env
            server = server.server()
        if isinstance(server, list | tuple):
            if not server:
                raise ValueError("MCPToolingEnv: the stdio command is empty")
            server = mcp.StdioServerParameters(command=server[0], args=list(server[1:]), env=env)
        self._client = mcp.Client(server)
        self._owner: asyncio.Task[None] | None = None  # holds the session (module docstring)
        self._opened: asyncio.Future[None] | None = None
        self._leave: asyncio.Event | None = None
        self.limits = CallLimits(timeout_s, max_output_chars)
        self.metrics = ToolMetrics()
        self.tool_schemas: list[ToolSchema] | None = None  # set by `ainitialize`

    @property
    def is_initialized(self) -> bool:
        return self._owner is not None and self.tool_schemas is not None

    async def ainitialize(self) -> None:
        """Seed 004's setup: connect and read the tool list once (then `list_tools()` needs
        no await and `tool_schemas` / `tool_registry` are filled)."""
        self.tool_schemas = await self._fetch_tools()

    @property
    def tool_registry(self) -> dict[str, Callable[..., Awaitable[str]]]:
        """Seed 004's name: tool name -> an async callable running it on the server."""

        def caller(name: str) -> Callable[..., Awaitable[str]]:
            async def call(**kwargs: object) -> str:
                return await self.aexecute(name, kwargs)

            return call

        names = [t["function"]["name"] for t in self.tool_schemas or []]
        return {name: caller(name) for name in names}

    async def aexecute(self, tool_name: str, tool_args: Mapping[str, object]) -> str:
        """Seed 004's call: the text the model reads (errors included, never raised)."""
        return await aexecute(self, tool_name, tool_args)

    async def connect(self) -> MCPToolingEnv:
        """Open the session once (in the owner task) and wait until it is open."""
        if self._owner is None:
            loop = asyncio.get_running_loop()
            opened, leave = loop.create_future(), asyncio.Event()
            self._opened, self._leave = opened, leave
            self._owner = loop.create_task(self._hold(opened, leave), name="mcp-session")
        assert self._opened is not None
        await asyncio.shield(self._opened)
        return self

    async def _hold(self, opened: asyncio.Future[None], leave: asyncio.Event) -> None:
        """The owner task: enter the client, wait for `aclose`, leave in this same task."""
        try:
            async with self._client:
                opened.set_result(None)
                await leave.wait()
        except BaseException as exc:
            if not opened.done():  # the session never opened: the caller gets why
                opened.set_exception(exc)
            else:
                raise

    async def __aenter__(self) -> MCPToolingEnv:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def list_tools(self) -> Awaitable[list[ToolSchema]]:
        """The tools' OpenAI schemas: after `ainitialize` a `ToolList` (a list, awaitable
        too), before it a coroutine that asks the server."""
        if self.tool_schemas is not None:
            return ToolList(self.tool_schemas)
        return self._fetch_tools()

    async def _fetch_tools(self) -> list[ToolSchema]:
        await self.connect()
        listing = await self._client.list_tools()
        return [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description or "",
                    "parameters": t.input_schema or {"type": "object", "properties": {}},
                },
            }
            for t in listing.tools
        ]

    async def call_tool(self, name: str, arguments: Mapping[str, object]) -> ToolResult:
        async def run() -> tuple[str, bool]:
            await self.connect()
            result = await self._client.call_tool(name, arguments or {})
            return _text(result), bool(result.is_error)

        return await guarded_call(name, run, self.limits, self.metrics)

    async def aclose(self) -> None:
        """Close the session (from any task of the loop that opened it)."""
        owner, self._owner = self._owner, None
        if owner is None or self._leave is None:
            return
        self._leave.set()
        await owner


def _text(result: CallToolResult) -> str:
    """A `CallToolResult` as text: its text blocks joined; other blocks named by type."""
    parts = []
    for block in result.content:
        text = getattr(block, "text", None)
        parts.append(text if text is not None else f"[{getattr(block, 'type', 'content')}]")
    if not parts and result.structured_content is not None:
        import json

        return json.dumps(result.structured_content, ensure_ascii=False)
    return "\n".join(parts)
