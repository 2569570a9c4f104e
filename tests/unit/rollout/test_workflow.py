"""`RolloutWorkflow` + `WorkflowExecutor` (the seed 004 API) on the real built-in engine."""

from __future__ import annotations

import asyncio
import threading

import pytest

from nexrl.agents.workflows import SingleTurnWorkflow, ToolWorkflow
from nexrl.inference.protocol import GenerationRequest, SamplingParams
from nexrl.rollout.workflow import RolloutWorkflow, WorkflowExecutor

ROW = {"uid": 0, "prompt": "what is 2+3?"}


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def reward_five(prompt, completion, **row):
    return 1.0


class OneTurn(RolloutWorkflow):
    """Rejects rows with odd `uid`; sleeps `delay` seconds first."""

    def __init__(self, delay: float = 0.0, fail: bool = False) -> None:
        self.delay, self.fail = delay, fail

    async def arun_episode(self, engine, data):
        await asyncio.sleep(self.delay)
        if self.fail:
            raise RuntimeError("environment down")
        if data["uid"] % 2:
            return None
        ids = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": data["prompt"]}],
            add_generation_prompt=True,
            return_dict=False,
        )
        resp = await engine.agenerate(GenerationRequest(list(ids), SamplingParams(4, 0.0)))
        out = resp.outputs[0]
        return {
            "uid": data["uid"],
            "prompt_ids": list(resp.input_ids),
            "response_ids": out.output_ids,
            "response_logprobs": out.output_logprobs,
            "loss_mask": [1] * len(out.output_ids),
            "reward": float(data["uid"]),
        }


@pytest.fixture(scope="module")
def executor(tool_engine):
    ex = WorkflowExecutor(tool_engine, max_concurrent=4)
    yield ex
    ex.shutdown()


def test_a_slow_reward_does_not_hold_up_the_other_episodes(executor):
    """Two episodes' rewards meet at a barrier: on the event loop the first would block
    it and the second never arrive. An async reward is awaited."""
    meet, threads = threading.Barrier(2, timeout=10), set()

    def slow(prompt, completion, **row):
        threads.add(threading.current_thread().name)
        meet.wait()
        return 1.0

    async def judged(prompt, completion, **row):
        return {"reward": 0.5, "scores": {"judge": 0.5}}

    trajs = executor.rollout([ROW, ROW], SingleTurnWorkflow(reward_fn=slow, max_tokens=4))
    assert [t["reward"] for t in trajs] == [1.0, 1.0] and "workflow-executor" not in threads
    (t,) = executor.rollout([ROW], SingleTurnWorkflow(reward_fn=judged, max_tokens=4))
    assert t["reward"] == 0.5 and t["scores"] == {"judge": 0.5}


def test_tool_workflow_rejects_an_unknown_on_rewrite_at_construction():
    with pytest.raises(ValueError, match="on_rewrite must be 'error' or 'split', got 'merge'"):
        ToolWorkflow(tools=[add], on_rewrite="merge")


def test_an_engine_without_a_tokenizer_gets_a_clear_error():
    from nexrl.agents.workflows import engine_tokenizer

    class NoTokenizer:
        pass

    with pytest.raises(TypeError, match="NoTokenizer has no `tokenizer`"):
        engine_tokenizer(NoTokenizer())


def test_tool_workflow_rollout_is_token_exact(executor, tool_engine):
    workflow = ToolWorkflow(
        tools=[add], max_turns=2, max_tokens=16, temperature=0.0, reward_fn=reward_five
    )
    trajs = executor.rollout([ROW, ROW, ROW], workflow)
    assert len(trajs) == 3
    t = trajs[0]
    mask = t["loss_mask"]
    assert mask[0] == 1 and mask[-1] == 1 and 0 in mask  # call, tool result (masked), call
    assert sum(mask) == 8  # two turns of 3 call tokens + <|im_end|>
    assert len(t["response_logprobs"]) == len(t["response_ids"]) == len(mask)
    assert t["reward"] == 1.0 and t["agent_metrics"]["agent/tool_calls"] == 1
    whole = t["prompt_ids"] + t["response_ids"]
    tok = tool_engine.tokenizer
    tool_msg = tok.decode([i for i, m in zip(t["response_ids"], mask, strict=True) if not m])
    assert "<tool_response>\n5\n</tool_response>" in tool_msg
    assert t["model_version"] == 0 and set(t["token_versions"]) <= {-1, 0}
    assert len(whole) == len(t["prompt_ids"]) + len(mask)


def test_wait_counts_accepted_episodes_only(executor):
    for uid in range(6):
        executor.submit({"uid": uid, "prompt": "hi"}, OneTurn())
    got = executor.wait(3, timeout=60)
    assert sorted(t["uid"] for t in got) == [0, 2, 4]


def test_prepare_batch_filters_with_should_accept(executor):
    rows = [[{"uid": u, "prompt": "hi"} for u in range(b, b + 4)] for b in range(0, 40, 4)]
    batch = executor.prepare_batch(
        rows, OneTurn(), should_accept=lambda ts: ts[0]["reward"] >= 4, batch_size=3
    )
    assert len(batch) == 3
    assert all(t["reward"] >= 4 and t["uid"] % 2 == 0 for t in batch)


def test_wait_times_out_and_errors_reach_the_caller(tool_engine):
    ex = WorkflowExecutor(tool_engine)
    try:
        ex.submit({"uid": 0, "prompt": "hi"}, OneTurn(delay=30))
        with pytest.raises(TimeoutError, match="0 of 1"):
            ex.wait(1, timeout=0.2)
    finally:
        ex.shutdown()
    ex = WorkflowExecutor(tool_engine)
    try:
        ex.submit({"uid": 0, "prompt": "hi"}, OneTurn(fail=True))
        with pytest.raises(RuntimeError, match="environment down"):
            ex.wait(1, timeout=60)
    finally:
        ex.shutdown()


def test_engine_api_passes_through(executor, tool_engine):
    assert executor.check_health() is True
    assert executor.version == tool_engine.version == 0


def test_bad_episode_result_is_named(tool_engine):
    class Bad(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            return "text"

    ex = WorkflowExecutor(tool_engine)
    try:
        ex.submit(ROW, Bad())
        with pytest.raises(TypeError, match="arun_episode returned str"):
            ex.wait(1, timeout=60)
    finally:
        ex.shutdown()
