"""Rollout workers against the real in-process engine, loader and pool."""

import pytest

from nexrl.data import InMemoryDataLoader
from nexrl.inference.client import LLMServiceClient
from nexrl.monitoring import ActivityTracker, ActivityTrackerProxy
from nexrl.pools import TrajectoryPool
from nexrl.rewards import shift_letters
from nexrl.rollout.workers import SingleTurnRolloutWorker


@pytest.fixture
def parts(tiny_model_path):
    tracker = ActivityTracker({})
    loader = InMemoryDataLoader({}, items=[{"prompt": "abcd>", "answer": "bcde", "uid": "u0"}])
    pool = TrajectoryPool({"batch_size": 4, "group_size": 4, "key_list": ["uid"]})
    client = LLMServiceClient({"backend": "builtin", "model": tiny_model_path, "model_tag": "t"})
    return tracker, loader, pool, client


def make_worker(parts, reward, **config):
    tracker, loader, pool, client = parts
    cfg = {"group_size": 4, "max_tokens": 4, "max_task_retries": 1, **config}
    worker = SingleTurnRolloutWorker(cfg, client, reward)
    worker.set_module_name("rollout_worker_0")
    worker.set_activity_tracker(ActivityTrackerProxy(tracker))
    pool.set_activity_tracker(ActivityTrackerProxy(tracker))
    worker.set_module_references(pool, loader, None)
    return worker


def test_group_reaches_the_pool_with_engine_tokens(parts):
    tracker, loader, pool, _ = parts
    worker = make_worker(parts, shift_letters)
    assert worker._loop_once()
    batch = pool.get_batch()
    assert len(batch) == 4 and len(set(batch.values["uid"])) == 1
    for ids, lps in zip(
        batch.values["response_ids"], batch.values["response_logprobs"], strict=True
    ):
        assert len(ids) == len(lps) and all(lp <= 0 for lp in lps)
    assert all(0.0 <= r <= 1.0 for r in batch.values["reward"])


def test_raising_reward_is_reported_retried_then_counted(parts):
    tracker, loader, pool, _ = parts

    def broken(prompt, completion, **row):
        raise ZeroDivisionError("bad reward")

    worker = make_worker(parts, broken)
    assert worker._loop_once()  # attempt 1 fails: task back to the loader
    assert len(loader) == 1
    assert worker._loop_once()  # attempt 2 fails: retries exhausted
    assert len(loader) == 0 and pool.is_empty()
    assert tracker.get_counters()["tasks_failed/train"] == 1
    errors = tracker.error_reporter.get_errors()
    assert [e.exception_type for e in errors] == ["ZeroDivisionError"] * 2


def test_dynamic_sampling_drops_groups_with_one_reward_value(parts):
    tracker, loader, pool, _ = parts
    worker = make_worker(parts, lambda prompt, completion, **row: 0.5, dynamic_sampling=True)
    assert worker._loop_once()
    assert pool.is_empty()
    assert tracker.get_counters()["groups_dropped/dynamic_sampling"] == 1


def test_pool_lock_sends_the_task_back_for_re_rollout(parts):
    tracker, loader, pool, _ = parts
    pool.notify_weight_sync_starting()
    worker = make_worker(parts, shift_letters)
    assert worker._loop_once()
    assert pool.is_empty() and len(loader) == 1  # same task waits at the front
    assert loader.get_next_item()["prompt"] == "abcd>"
