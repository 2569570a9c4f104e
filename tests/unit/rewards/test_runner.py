"""RewardRunner: both signatures, sync/async, failures counted by kind, pool isolation."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from nexrl.rewards import exact_match
from nexrl.rewards.runner import RewardResult, RewardRunner


def seed_reward(prompt, completion, prompt_ids, completion_ids, **kwargs):
    return float(len(completion_ids) == kwargs["n"])


def components(prompt, completion, **row):
    return {"reward": 0.5, "scores": {"format": 1.0, "correct": 0.0}}


async def async_reward(prompt, completion, answer, **row):
    await asyncio.sleep(0)
    return RewardResult(float(completion == answer), {"len": len(completion)})


def hangs(prompt, completion, **row):
    time.sleep(60)
    return 1.0


def dies(prompt, completion, **row):
    os._exit(3)


def raises(prompt, completion, **row):
    raise KeyError("answer")


def returns_text(prompt, completion, **row):
    return "1.0"


def test_seed_signature_gets_token_ids() -> None:
    with RewardRunner(seed_reward, timeout_s=5) as runner:
        assert runner.seed_signature
        out = runner.score("p", "c", [1, 2], [3, 4, 5], {"n": 3})
        assert out.ok and out.reward == 1.0
        assert runner.score("p", "c", [1], [3], {"n": 3}).reward == 0.0


def test_row_keys_filtered_for_functions_without_kwargs() -> None:
    def strict(prompt, completion, answer):
        return float(completion == answer)

    with RewardRunner(strict, timeout_s=5) as runner:
        assert runner.score("p", "x", row={"answer": "x", "index": 4}).reward == 1.0
    with RewardRunner(exact_match, timeout_s=5) as runner:
        assert runner.score("p", " y ", row={"answer": "y", "index": 4}).reward == 1.0


def test_components_and_async() -> None:
    with RewardRunner(components, timeout_s=5) as runner:
        out = runner.score("p", "c")
        assert (out.reward, out.scores) == (0.5, {"format": 1.0, "correct": 0.0})
    with RewardRunner(async_reward, timeout_s=5) as runner:
        assert runner.is_async
        out = runner.score("p", "ab", row={"answer": "ab"})
        assert (out.reward, out.scores) == (1.0, {"len": 2.0})
        out = asyncio.run(runner.ascore("p", "ab", row={"answer": "x"}))
        assert (out.reward, out.scores) == (0.0, {"len": 2.0})


def test_failures_are_outcomes_not_exceptions() -> None:
    with RewardRunner(raises, timeout_s=5) as runner:
        out = runner.score("p", "c")
        assert out.error == "exception" and out.reward is None and "KeyError" in out.detail
    with RewardRunner(returns_text, timeout_s=5) as runner:
        out = asyncio.run(runner.ascore("p", "c"))
        assert out.error == "exception" and "expected a float" in out.detail
        assert runner.stats == {"calls": 1, "timeout": 0, "crash": 0, "exception": 1}


def test_inline_timeout_unblocks_the_caller() -> None:
    def slow(prompt, completion, **row):
        time.sleep(1.0)
        return 1.0

    with RewardRunner(slow, timeout_s=0.1) as runner:
        assert runner.score("p", "c").error == "timeout"
        assert asyncio.run(runner.ascore("p", "c")).error == "timeout"
        assert runner.stats["timeout"] == 2


@pytest.mark.slow
def test_process_pool_kills_hangs_and_survives_crashes() -> None:
    with RewardRunner(hangs, timeout_s=0.5, use_process_pool=True, max_workers=2) as runner:
        outs = [runner.score("p", "c") for _ in range(2)]
        assert [o.error for o in outs] == ["timeout", "timeout"]
    runner = RewardRunner(dies, timeout_s=10, use_process_pool=True, max_workers=1)
    try:
        out = runner.score("p", "c")
        assert out.error == "crash" and "3" in out.detail
        runner.fn = components  # the pool replaced its dead worker and goes on
        out = asyncio.run(runner.ascore("p", "c"))
        assert out.ok and out.scores == {"format": 1.0, "correct": 0.0}
        assert runner.stats == {"calls": 2, "timeout": 0, "crash": 1, "exception": 0}
    finally:
        runner.close()


@pytest.mark.slow
def test_process_pool_async_and_seed_rewards() -> None:
    with RewardRunner(async_reward, timeout_s=10, use_process_pool=True) as runner:
        assert runner.score("p", "ab", row={"answer": "ab"}).reward == 1.0

        async def many():
            return await asyncio.gather(
                *(runner.ascore("p", str(i % 2), row={"answer": "1"}) for i in range(8))
            )

        assert [o.reward for o in asyncio.run(many())] == [0.0, 1.0] * 4


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="not callable"):
        RewardRunner(3)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardRunner(components, timeout_s=0)
