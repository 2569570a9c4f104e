"""One tool-using episode on an `InferenceEngine`, token-exact.

The loop a multi-turn workflow runs: generate from the accumulated ids, parse
the text for tool calls, run them in the environment (concurrently, off the
engine: other episodes keep the engine busy meanwhile), append the tool
messages as the template renders them, repeat until the model answers without
a call, the turn budget is spent, or the context is full. Malformed calls are
never executed: they are counted and the episode ends there (the reward
function sees the text; a model that writes broken calls is not rewarded for
it).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from nexrl.agents.tokens import MultiTurnTokens, TokenSample
from nexrl.envs.base import ToolingEnv, run_tool_calls
from nexrl.inference.protocol import GenerationRequest, InferenceEngine, SamplingParams
from nexrl.inference.tool_parsers import ToolCallParser


@dataclass
class Episode:
    """What one episode produced: training samples, the chat history, and its metrics."""

    samples: list[TokenSample]
    messages: list[Mapping[str, object]]
    finish: str  # "answer" | "max_turns" | "context" | "parse_failure" | "length" | "abort"
    metrics: dict[str, float] = field(default_factory=dict)


async def run_tool_episode(
    engine: InferenceEngine,
    tokenizer: Any,
    messages: Sequence[Mapping[str, object]],
    env: ToolingEnv,
    parser: ToolCallParser,
    sampling: SamplingParams,
    *,
    max_turns: int = 8,
    max_context: int | None = None,
    on_rewrite: Literal["error", "split"] = "error",
) -> Episode:
    """Run turns until an answer without tool calls (see the module docstring)."""
    tools = await env.list_tools()
    traj = MultiTurnTokens(tokenizer, messages, tools=tools or None, on_rewrite=on_rewrite)
    limit = max_context or getattr(engine, "max_model_len", None)
    model_s = env_s = 0.0
    calls = parse_failures = 0
    finish = "max_turns"
    for turn in range(max_turns):
        ids = traj.prompt_ids()
        if limit is not None and len(ids) >= limit:
            finish = "context"
            break
        start = time.perf_counter()
        resp = await engine.agenerate(GenerationRequest(ids, sampling))
        model_s += time.perf_counter() - start
        out = resp.outputs[0]
        traj.add_assistant(out.output_ids, out.output_logprobs, out.output_versions)
        _content, found, failures = parser.parse(out.text)
        parse_failures += len(failures)
        if failures:
            env_metrics = getattr(env, "metrics", None)
            if env_metrics is not None:
                env_metrics.parse_failures += len(failures)
            finish = "parse_failure"
            break
        if out.finish_reason != "stop":
            finish = out.finish_reason
            break
        if not found:
            finish = "answer"
            break
        if turn == max_turns - 1:  # no turn left to read the results: do not run the calls
            break
        start = time.perf_counter()
        tool_messages = await run_tool_calls(env, found)
        env_s += time.perf_counter() - start
        calls += len(found)
        traj.add_messages(tool_messages)
    metrics = {
        **traj.metrics(),
        "agent/tool_calls": calls,
        "agent/parse_failures": parse_failures,
        "agent/model_time_s": model_s,
        "agent/env_time_s": env_s,
    }
    return Episode(traj.samples(), traj.messages, finish, metrics)
