"""A whole tool-using episode on the real engine (a scripted model) and a local tool env."""

from __future__ import annotations

import asyncio

import pytest
import torch

from nexrl.agents import chat_with_tools, run_tool_episode
from nexrl.envs import LocalToolingEnv
from nexrl.inference.engine import Engine
from nexrl.inference.protocol import SamplingParams
from nexrl.inference.tool_parsers import get_parser
from tests.unit.agents.chatml import build_scripted_model

pytestmark = pytest.mark.slow  # an engine per test, a few turns each

CALL = '{"name": "add", "arguments": {"a": 2, "b": 3}}'


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def _episode(path, max_turns=3):
    torch.set_num_threads(1)
    engine = Engine(path, max_batch_size=4)
    env = LocalToolingEnv([add])
    try:
        return (
            asyncio.run(
                run_tool_episode(
                    engine,
                    engine.tokenizer,
                    [{"role": "user", "content": "what is 2+3?"}],
                    env,
                    get_parser("hermes"),
                    SamplingParams(max_new_tokens=16, temperature=0),
                    max_turns=max_turns,
                )
            ),
            env,
            engine.tokenizer,
        )
    finally:
        engine.shutdown()


def test_tool_turns_are_token_exact(tmp_path):
    path = build_scripted_model(tmp_path / "m", ["<tool_call>", CALL, "</tool_call>"])
    episode, env, tok = _episode(path)
    assert episode.finish == "max_turns"
    (sample,) = episode.samples
    tools = asyncio.run(env.list_tools())
    rendered = tok.apply_chat_template(
        episode.messages, tools=tools, tokenize=True, return_dict=False
    )
    assert sample.input_ids == rendered[: len(sample.input_ids)]  # ChatML renders the EOS
    tool_msgs = [m for m in episode.messages if m["role"] == "tool"]
    assert [m["content"] for m in tool_msgs] == ["5", "5"]
    policy = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
    assert len(policy) == 3 * 4  # three turns of call tokens + <|im_end|>
    assert all(v == 0 for v, m in zip(sample.versions, sample.loss_mask, strict=True) if m)
    m = episode.metrics
    assert (m["agent/turns"], m["agent/tool_calls"], m["agent/parse_failures"]) == (3, 2, 0)
    assert m["agent/masked_tokens"] == len(sample.input_ids) - 12
    assert env.metrics.calls == 2


@pytest.mark.parametrize(
    ("script", "finish"),
    [(["The answer is 5."], "answer"), (["<tool_call>", '{"name": "add", "argu'], "parse_failure")],
)
def test_episode_ends(tmp_path, script, finish):
    episode, env, _ = _episode(build_scripted_model(tmp_path / "m", script))
    assert episode.finish == finish and episode.metrics["agent/turns"] == 1
    assert env.metrics.calls == 0
    assert env.metrics.parse_failures == int(finish == "parse_failure")


def test_chat_with_tools_returns_openai_tool_calls(tmp_path):
    torch.set_num_threads(1)
    path = build_scripted_model(tmp_path / "m", ["<tool_call>", CALL, "</tool_call>"])
    engine = Engine(path, max_batch_size=4)
    tools = asyncio.run(LocalToolingEnv([add]).list_tools())
    ask = [{"role": "user", "content": "what is 2+3?"}]
    greedy = SamplingParams(max_new_tokens=16, temperature=0)
    try:
        reply = asyncio.run(chat_with_tools(engine, engine.tokenizer, ask, greedy, tools=tools))
        plain = asyncio.run(chat_with_tools(engine, engine.tokenizer, ask, greedy))
        cut = SamplingParams(max_new_tokens=2, temperature=0)
        truncated = asyncio.run(chat_with_tools(engine, engine.tokenizer, ask, cut, tools=tools))
    finally:
        engine.shutdown()
    assert reply["finish_reason"] == "tool_calls" and reply["content"] is None
    (call,) = reply["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    assert len(reply["output_ids"]) == len(reply["logprobs"]) == 4
    assert plain["tool_calls"] == [] and plain["content"].startswith("<tool_call>")
    assert truncated["tool_calls"] == [] and truncated["finish_reason"] == "length"
    assert truncated["parse_failures"] == ["truncated: <tool_call> is never closed"]
