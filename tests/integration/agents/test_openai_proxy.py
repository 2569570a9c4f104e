"""An agent written against the `openai` SDK, trained through the recording proxy: its
completions come back as token-exact trajectories with its reward."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest

from nexrl.agents.proxy import RecordingProxy, merge_completions
from tests.integration.agents.test_remote_and_tools import TOOLS, add
from tests.integration.inference.conftest import ServerThread


def my_agent(base_url: str, api_key: str, question: str) -> float:
    """Unmodified user code: the openai SDK, one tool, two turns; returns its reward."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": question}]
    reply = client.chat.completions.create(
        model="policy", messages=messages, tools=TOOLS, max_tokens=16, temperature=0
    )
    call = reply.choices[0].message.tool_calls[0]
    result = add(**json.loads(call.function.arguments))
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": str(result)},
    ]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=16, temperature=0)
    return 1.0 if result == 5 else 0.0


@pytest.fixture(scope="module")
def proxy(engine):
    rec = RecordingProxy(engine)
    with ServerThread(rec.app) as srv:
        yield rec, srv.url


def test_openai_sdk_agent_session_becomes_trajectories(proxy, engine):
    """The template re-renders the parsed call in its own JSON (arguments as a string), so
    the second prompt does not extend the first sample: two samples."""
    rec, url = proxy
    reward = my_agent(RecordingProxy.base_url(url, "s1"), "any", "what is 2+3?")
    trajs = rec.trajectories("s1", reward=reward)
    assert len(trajs) == 2 and all(t["reward"] == 1.0 for t in trajs)
    first, second = trajs
    tok = engine.tokenizer
    assert tok.decode(first["response_ids"]).startswith("<tool_call>")
    assert len(first["response_logprobs"]) == len(first["response_ids"])
    assert "<tool_response>\n5\n</tool_response>" in tok.decode(second["prompt_ids"])
    assert all(v == engine.version for t in trajs for v in t["token_versions"])


def chat_agent(base_url: str, api_key: str, question: str) -> float:
    """Two turns sending the model's reply back as it wrote it, then one more question."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": question}]
    for follow_up in ("and 3+4?", None):
        reply = client.chat.completions.create(
            model="policy", messages=messages, max_tokens=16, temperature=0
        )
        if follow_up is not None:
            text = reply.choices[0].message.content
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": follow_up},
            ]
    return 1.0


def test_successive_completions_of_a_conversation_merge_into_one_sample(proxy, engine):
    rec, url = proxy
    chat_agent(RecordingProxy.base_url(url, "s3"), "any", "what is 2+3?")
    first, second = rec.sessions["s3"].completions
    (traj,) = rec.trajectories("s3", reward=1.0)
    assert traj["prompt_ids"] == first["prompt_ids"] and traj["turns"] == [0, 1]
    ids, mask = traj["prompt_ids"] + traj["response_ids"], [0] * len(traj["prompt_ids"])
    mask += traj["loss_mask"]
    assert ids[: len(second["prompt_ids"])] == second["prompt_ids"]  # token-exact prefix
    policy = [t for t, m in zip(ids, mask, strict=True) if m]
    assert policy == first["response_ids"] + second["response_ids"]
    gap = second["prompt_ids"][len(first["prompt_ids"]) + len(first["response_ids"]) :]
    assert "user\nand 3+4?" in engine.tokenizer.decode(gap)
    assert (
        len(traj["response_logprobs"])
        == len(traj["token_versions"])
        == len(mask) - len(traj["prompt_ids"])
    )


def _completion(prompt, response, turn):
    n = len(response)
    return {
        "prompt_ids": prompt,
        "response_ids": response,
        "response_logprobs": [-0.5] * n,
        "loss_mask": [1] * n,
        "token_versions": [turn] * n,
        "model_version": turn,
        "finish_reason": "stop",
        "response": str(response),
        "turn": turn,
    }


def test_merge_follows_each_conversation_and_keeps_others_apart():
    a0 = _completion([1, 2], [3, 4], 0)
    b0 = _completion([9], [8], 1)  # another conversation in the same session
    a1 = _completion([1, 2, 3, 4, 5, 6], [7], 2)  # extends a0 by the env ids 5, 6
    c0 = _completion([1, 2, 3, 9], [7], 3)  # shares a prefix but rewrote a0's reply
    merged = merge_completions([a0, b0, a1, c0])
    assert [t["turns"] for t in merged] == [[0, 2], [1], [3]]
    a = merged[0]
    assert a["response_ids"] == [3, 4, 5, 6, 7] and a["loss_mask"] == [1, 1, 0, 0, 1]
    assert a["response_logprobs"] == [-0.5, -0.5, 0.0, 0.0, -0.5]
    assert a["token_versions"] == [0, 0, -1, -1, 2] and a["model_version"] == 0
    assert a0["response_ids"] == [3, 4]  # the recorded completions are left as they were


def test_reward_endpoint_and_missing_reward(proxy):
    rec, url = proxy
    my_agent(RecordingProxy.base_url(url, "s2"), "any", "2+3?")
    with pytest.raises(ValueError, match="session 's2' has no reward"):
        rec.trajectories("s2")
    httpx.post(f"{url}/sessions/s2/reward", json={"reward": 0.5}).raise_for_status()
    assert [t["reward"] for t in rec.trajectories("s2")] == [0.5, 0.5]
    with pytest.raises(ValueError, match="made no chat completion"):
        rec.trajectories("never")


@pytest.mark.slow
def test_openai_sdk_agent_trains_in_the_pipeline(agent_config):
    from nexrl.controller import NexRLController

    cfg = agent_config(
        "rollout_worker.workflow=nexrl.agents.proxy:OpenAIAgentWorkflow",
        "+rollout_worker.workflow_kwargs.agent=tests.integration.agents.workflows:sdk_agent",
        "weight.sync_mode=fully-async",
        "weight.staleness_threshold=1",
    )
    controller = NexRLController(cfg)
    controller.run()
    lines = [json.loads(x) for x in (Path(controller.run_dir) / "metrics.jsonl").open()]
    train = [x for x in lines if "train/loss" in x]
    assert [x["step"] for x in train] == [1, 2, 3]
    assert all(x["staleness/max"] <= 1 for x in train)


async def async_agent(base_url: str, api_key: str, data: dict) -> float:
    """Unmodified user code on the async SDK: awaited, not called in a thread."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": data["prompt"]}], max_tokens=4
    )
    return float(reply.choices[0].message.content is not None)


def test_an_async_agent_is_awaited_and_the_close_hook_stops_the_proxy(engine):
    from nexrl.agents.proxy import OpenAIAgentWorkflow

    workflow = OpenAIAgentWorkflow(async_agent)

    async def episode_then_close():
        trajs = await workflow.arun_episode(engine, {"prompt": "what is 2+3?"})
        url = workflow._server.url
        await workflow.aclose()
        return trajs, url

    trajs, url = asyncio.run(episode_then_close())
    assert len(trajs) == 1 and trajs[0]["reward"] == 1.0 and trajs[0]["response_ids"]
    with pytest.raises(httpx.TransportError):
        httpx.get(url, timeout=2)
