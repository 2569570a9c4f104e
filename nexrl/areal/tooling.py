"""Seed 004's tool names: `ToolExecutor` and the tooling environments.

`ToolExecutor.aexecute_tool(completion)` reads the tool calls in a model's
completion (nexrl's tool-call parsers: hermes / qwen, llama3_json, mistral),
runs them in its environment concurrently, and returns the tool messages. With
a tokenizer it returns their token ids instead: the ids its chat template
writes for those messages and the next generation prompt, ready to append to
`req.input_ids` (the seed's `req.input_ids += res`). The ids come from the
difference of two renderings (with and without the tool messages), so the
template's own tokens are kept exactly (see `nexrl.agents.tokens`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nexrl.envs.base import MCPToolingEnvConfig, ToolingEnv, ToolList, run_tool_calls
from nexrl.envs.local import LocalToolingEnv
from nexrl.inference.tool_parsers import get_parser

__all__ = ["LocalToolingEnv", "MCPToolingEnvConfig", "ToolExecutor", "ToolList", "ToolingEnv"]


class ToolExecutor:
    """Tools of one workflow instance, executed from model completions.

    tokenizer: when set, `aexecute_tool` returns token ids (see the module docstring).
    parser: the tool-call format of the model (default `hermes`, Qwen's).
    env: the environment holding the tools (default: a new `LocalToolingEnv`).
    """

    def __init__(
        self, tokenizer: Any = None, parser: str = "hermes", env: ToolingEnv | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.parser = get_parser(parser)
        self.env: Any = env if env is not None else LocalToolingEnv()

    def register_tool(self, func: Callable[..., Any]) -> Callable[..., Any]:
        """Add `func` as a tool (usable as a decorator)."""
        return self.env.register_tool(func)

    async def aexecute_tool(
        self, completion: str, history: list[dict[str, Any]] | None = None
    ) -> list[Any]:
        """Run the calls in `completion`; the `tool` messages, or (with a tokenizer) the
        ids to append after the completion. `history`: the conversation so far (the
        completion's assistant turn is added), for templates that render tools in context."""
        _, calls, failures = self.parser.parse(completion)
        messages = await run_tool_calls(self.env, calls, failures)
        if self.tokenizer is None:
            return messages
        before = [*(history or []), {"role": "assistant", "content": completion}]
        head = self.tokenizer.apply_chat_template(before, tokenize=True, return_dict=False)
        full = self.tokenizer.apply_chat_template(
            [*before, *messages], tokenize=True, add_generation_prompt=True, return_dict=False
        )
        if list(full[: len(head)]) != list(head):
            raise ValueError("the chat template rewrote the conversation; pass `history`")
        return list(full[len(head) :])
