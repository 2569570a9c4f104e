"""`MCPToolingEnv`: the tools of a Model Context Protocol server.

Uses the official `mcp` SDK (2.x, `pip install nexrl[agents]`) as a client over
either transport the SDK speaks: stdio (the env launches the server command as
a subprocess) or streamable HTTP (a URL). The MCP tool listing maps directly
onto OpenAI tool schemas (`inputSchema` is a JSON schema). Tool errors
(`isError`), transport errors and timeouts come back to the model as error
results, as with `LocalToolingEnv`.

The SDK's client lives in an anyio task scope: open and close the env in the
same task, best with `async with MCPToolingEnv(...) as env:`.
"""

from __future__ import annotations

from typing import Any

from nexrl.envs.base import CallLimits, ToolMetrics, ToolResult, guarded_call


def _import_mcp():
    try:
        import mcp
    except ImportError as exc:  # the extra is optional
        raise ImportError("MCPToolingEnv needs the MCP SDK: pip install 'nexrl[agents]'") from exc
    return mcp


class MCPToolingEnv:
    """Tools served by an MCP server.

    server: a streamable-HTTP URL (`http://127.0.0.1:8000/mcp`), or a command to launch over
        stdio as a list (`["python", "server.py"]`), or an `mcp.StdioServerParameters`.
    timeout_s / max_output_chars: per-call limits (see `nexrl.envs.base.CallLimits`).
    """

    def __init__(
        self,
        server: str | list[str] | Any,
        *,
        env: dict[str, str] | None = None,
        timeout_s: float | None = 30.0,
        max_output_chars: int = 8192,
    ) -> None:
        mcp = _import_mcp()
        if isinstance(server, list | tuple):
            if not server:
                raise ValueError("MCPToolingEnv: the stdio command is empty")
            server = mcp.StdioServerParameters(command=server[0], args=list(server[1:]), env=env)
        self._client = mcp.Client(server)
        self._open = False
        self.limits = CallLimits(timeout_s, max_output_chars)
        self.metrics = ToolMetrics()

    async def connect(self) -> MCPToolingEnv:
        if not self._open:
            await self._client.__aenter__()
            self._open = True
        return self

    async def __aenter__(self) -> MCPToolingEnv:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def list_tools(self) -> list[dict[str, Any]]:
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

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        async def run() -> tuple[str, bool]:
            await self.connect()
            result = await self._client.call_tool(name, arguments or {})
            return _text(result), bool(result.is_error)

        return await guarded_call(name, run, self.limits, self.metrics)

    async def aclose(self) -> None:
        if self._open:
            self._open = False
            await self._client.__aexit__(None, None, None)


def _text(result: Any) -> str:
    """A `CallToolResult` as text: its text blocks joined; other blocks named by type."""
    parts = []
    for block in result.content:
        text = getattr(block, "text", None)
        parts.append(text if text is not None else f"[{getattr(block, 'type', 'content')}]")
    if not parts and result.structured_content is not None:
        import json

        return json.dumps(result.structured_content, ensure_ascii=False)
    return "\n".join(parts)
