"""Multi-turn, tool-using agents: token-exact trajectories and the episode loop."""

from nexrl.agents.loop import Episode, run_tool_episode
from nexrl.agents.tokens import MultiTurnTokens, TemplateMismatchError, TokenSample

__all__ = ["Episode", "MultiTurnTokens", "TemplateMismatchError", "TokenSample", "run_tool_episode"]
