"""Multi-turn, tool-using agents: token-exact trajectories and the episode loop."""

from nexrl.agents.chat import chat_with_tools
from nexrl.agents.loop import Episode, run_tool_episode
from nexrl.agents.tokens import MultiTurnTokens, TemplateMismatchError, TokenSample

__all__ = [
    "Episode",
    "MultiTurnTokens",
    "TemplateMismatchError",
    "TokenSample",
    "chat_with_tools",
    "run_tool_episode",
]
