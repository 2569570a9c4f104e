"""Rollout workers against the real in-process engine, task owner, loader and pool."""

import pytest

from nexrl.config.schema import RolloutWorkerConfig
from nexrl.inference.client import LLMServiceClient
from nexrl.inference.prefix_cache import MIN_SHARED_TOKENS
from nexrl.rewards import shift_letters
from nexrl.types import Task
from tests.rollout_parts import build_rollout_side, context


@pytest.fixture
def client(tiny_model_path):
    return LLMServiceClient({"backend": "builtin", "model": tiny_model_path, "model_tag": "t"})


ITEMS = [{"prompt": "abcd>", "answer": "bcde", "uid": "u0"}]


def test_group_reaches_the_pool_with_engine_tokens(client):
    side = build_rollout_side(client, ITEMS, shift_letters)
    assert side.worker._loop_once()
    batch = side.pool.get_batch()
    assert len(batch) == 4 and len(set(batch.values["uid"])) == 1
    for ids, lps in zip(
        batch.values["response_ids"], batch.values["response_logprobs"], strict=True
    ):
        assert len(ids) == len(lps) and all(lp <= 0 for lp in lps)
    assert all(0.0 <= r <= 1.0 for r in batch.values["reward"])


def test_single_turn_groups_leave_their_replies_out_of_the_prefix_cache(client):
    """No next turn quotes a single-turn reply: only the prompt is cached (one longer
    than MIN_SHARED_TOKENS: a shorter one is not worth caching)."""
    text = "wxyzabcdefghijklmnop>"
    items = [{"prompt": text, "answer": "xyzabcdefghijklmnopq", "uid": "u9"}]
    side = build_rollout_side(client, items, shift_letters)
    cache, prompt_ids = client._engine.prefix, client.tokenizer(text)["input_ids"]
    assert len(prompt_ids) > MIN_SHARED_TOKENS
    before, known = cache.stats["cached_tokens"], cache.cached_length(prompt_ids)
    assert side.worker._loop_once()
    assert side.pool.get_batch().values["prompt_ids"][0] == prompt_ids
    assert cache.stats["cached_tokens"] - before == len(prompt_ids) - known


def test_raising_reward_is_reported_retried_then_counted(client):
    def broken(prompt, completion, **row):
        raise ZeroDivisionError("bad reward")

    side = build_rollout_side(client, ITEMS, broken)
    assert side.worker._loop_once()  # attempt 1 fails: task back to the loader
    assert len(side.loader) == 1
    assert side.worker._loop_once()  # attempt 2 fails: retries exhausted
    assert len(side.loader) == 0 and side.pool.is_empty()
    assert side.tracker.get_counters()["tasks_failed/train"] == 1
    errors = side.tracker.error_reporter.get_errors()
    assert [e.exception_type for e in errors] == ["RewardFailed"] * 2
    assert "ZeroDivisionError" in errors[0].message
    line = broken.__code__.co_firstlineno + 1  # the reward's own `raise`, file and line
    assert f"(at {__file__}:{line} in broken)" in errors[0].message
    assert side.tracker.get_counters()["rewards/failed/exception"] == 2


def test_a_hanging_reward_times_out_and_does_not_block_the_worker(client):
    import time

    def hangs(prompt, completion, **row):
        time.sleep(30)
        return 1.0

    cfg = RolloutWorkerConfig(group_size=2, max_tokens=4, max_task_retries=0, reward_timeout_s=0.2)
    side = build_rollout_side(client, ITEMS, hangs, worker=cfg)
    start = time.monotonic()
    assert side.worker._loop_once()
    assert time.monotonic() - start < 10  # not the 30 s of the reward
    counters = side.tracker.get_counters()
    assert counters["rewards/failed/timeout"] >= 1 and counters["tasks_failed/train"] == 1


def test_reward_components_travel_with_the_trajectory(client):
    def scored(prompt, completion, prompt_ids, completion_ids, **row):  # the seed's signature
        return {"reward": 0.5, "scores": {"format": 1.0, "length": len(completion_ids)}}

    cfg = RolloutWorkerConfig(group_size=2, max_tokens=4, max_task_retries=0)
    side = build_rollout_side(client, ITEMS, scored, worker=cfg)
    assert side.worker._loop_once()
    batch = side.pool.get_batch()
    assert batch.values["reward"] == [0.5, 0.5]
    assert [s["format"] for s in batch.values["scores"]] == [1.0, 1.0]
    assert [s["length"] for s in batch.values["scores"]] == [
        float(len(ids)) for ids in batch.values["response_ids"]
    ]


def test_dynamic_sampling_drops_groups_with_one_reward_value(client):
    side = build_rollout_side(
        client, ITEMS, lambda prompt, completion, **row: 0.5, ctx=context(dynamic_sampling=True)
    )
    assert side.worker._loop_once()
    assert side.pool.is_empty()
    assert side.tracker.get_counters()["groups_dropped/dynamic_sampling"] == 1


def test_reroll_sends_the_task_back_to_the_front(client):
    from nexrl.rollout.workers import SingleTurnRolloutWorker

    class Rerolling(SingleTurnRolloutWorker):
        def step(self, task):
            return "re-rollout"  # the seed's string answer

    side = build_rollout_side(client, ITEMS, shift_letters, worker_cls=Rerolling)
    assert side.worker._loop_once()
    assert side.pool.is_empty() and len(side.loader) == 1  # same task waits at the front
    again = side.loader.get_next_item()
    assert isinstance(again, Task) and again.data["prompt"] == "abcd>"
    assert side.tracker.get_counters()["rollout/released/re-rollout"] == 1


def test_chat_prompt_is_rendered_with_the_template_once(client):
    messages = [{"role": "user", "content": "abcd>"}]
    items = [{"prompt": messages, "answer": "bcde", "uid": "c0"}]
    cfg = RolloutWorkerConfig(group_size=2, max_tokens=4, max_task_retries=0)
    side = build_rollout_side(client, items, shift_letters, worker=cfg)
    assert side.worker._loop_once()
    batch = side.pool.get_batch()
    want = client.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=False
    )
    assert batch.values["prompt_ids"][0] == list(want)  # exactly the ids the engine saw
    assert batch.values["prompt"][0] == messages


def test_malformed_chat_prompt_names_the_column(client):
    items = [{"prompt": [{"content": "no role"}], "uid": "bad"}]
    side = build_rollout_side(client, items, shift_letters)
    assert side.worker._loop_once()
    message = side.tracker.error_reporter.get_errors()[0].message
    assert "'prompt' (data.prompt_key): message 0 needs a string 'role'" in message
