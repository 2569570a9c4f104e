"""A small real MCP server for the tests (the SDK's MCPServer, formerly FastMCP).

Run: `python mcp_calc_server.py stdio` or `python mcp_calc_server.py http PORT`.
"""

from __future__ import annotations

import sys
import time

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("calc")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def fail(message: str) -> str:
    """Always fails (to test error results)."""
    raise ToolError(message)


@server.tool()
def sleep(seconds: float) -> str:
    """Sleep, then answer (to test timeouts)."""
    time.sleep(seconds)
    return "woke"


@server.tool()
def echo(text: str) -> str:
    """Return the text (to test truncation)."""
    return text


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
