"""An agent written against the `openai` SDK, trained through the recording proxy: its
completions come back as token-exact trajectories with its reward."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from nexrl.agents.proxy import RecordingProxy
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
