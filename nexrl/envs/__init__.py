"""Tool environments for agentic rollouts: local Python tools and MCP servers."""

from nexrl.envs.base import ToolingEnv, ToolMetrics, ToolResult, run_tool_calls
from nexrl.envs.local import LocalToolingEnv

__all__ = [
    "LocalToolingEnv",
    "MCPToolingEnv",
    "ToolMetrics",
    "ToolResult",
    "ToolingEnv",
    "run_tool_calls",
]


def __getattr__(name: str):
    if name == "MCPToolingEnv":  # the `mcp` SDK is an optional extra
        from nexrl.envs.mcp_env import MCPToolingEnv

        return MCPToolingEnv
    raise AttributeError(name)
