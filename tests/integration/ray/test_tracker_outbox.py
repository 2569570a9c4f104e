"""The tracker calls nothing waits for (`start`, `end`, `increment`, `set_training_step`,
`experiment_logger_post`) reach a Ray tracker actor in batches through the process's
`Outbox`, in order; the proxy's reads see every earlier call."""

from __future__ import annotations

import json
import threading

import pytest

from nexrl.execute import REMOTE_CALLS
from nexrl.monitoring import ActivityTracker, ActivityTrackerProxy

pytestmark = [pytest.mark.ray]


def test_queued_calls_arrive_batched_and_reads_see_them(ray_local):
    import ray

    tracker = ray.remote(ActivityTracker).options(num_cpus=0, max_concurrency=8).remote({})
    proxy = ActivityTrackerProxy(tracker)
    REMOTE_CALLS.clear()
    for _ in range(300):  # far faster than one Ray call: most calls share a batch
        proxy.increment("tasks_done")
    assert proxy.get_counters() == {"tasks_done": 300}
    assert REMOTE_CALLS["apply"] < 100  # 300 increments, a few batches

    def work(i: int) -> None:
        for _ in range(20):
            with proxy.track(f"rollout_{i}", "step"):
                proxy.increment("tasks_done")

    before = REMOTE_CALLS["apply"]
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert proxy.is_quiescent()  # every queued `end` arrived before the read
    assert proxy.get_counters() == {"tasks_done": 380}
    assert REMOTE_CALLS["start"] == 0  # brackets travel in the batches too
    assert REMOTE_CALLS["apply"] - before < 3 * 80  # 240 queued calls shared batches
    ray.kill(tracker)


def test_train_step_and_logger_posts_are_queued_in_order(ray_local, tmp_path):
    import ray

    cfg = {"logger": {"run_dir": str(tmp_path), "backend": ["jsonl"]}}
    tracker = ray.remote(ActivityTracker).options(num_cpus=0, max_concurrency=8).remote(cfg)
    proxy = ActivityTrackerProxy(tracker)
    REMOTE_CALLS.clear()
    for step in range(1, 6):
        proxy.set_training_step(step)
        proxy.experiment_logger_post(backend="metrics", data={"train/loss": 1.0 / step})
    with pytest.raises(ValueError, match="unknown backend 'metric'"):  # raised here, not lost
        proxy.experiment_logger_post(backend="metric", data={"x": 1.0})
    assert proxy.get_training_step() == 5  # the read flushed the queue first
    assert REMOTE_CALLS["set_training_step"] == REMOTE_CALLS["experiment_logger_post"] == 0
    assert REMOTE_CALLS["apply"] < 10
    ray.get(tracker.close.remote())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    # each post took the step set just before it: the calls arrived in order
    assert [(r["step"], r["train/loss"]) for r in rows] == [(s, 1.0 / s) for s in range(1, 6)]
    ray.kill(tracker)


def test_a_failing_queued_post_is_reported_and_the_batch_goes_on():
    tracker = ActivityTracker({})
    token = tracker.start("m", "w")

    def broken(*args, **kwargs):
        raise OSError("disk full")

    tracker.experiment_logger.post = broken
    tracker.apply(
        [("experiment_logger_post", ("metrics",), {"data": {"x": 1.0}}), ("end", (token,))]
    )
    assert tracker.is_quiescent()  # the `end` after the failed post still ran
    health = tracker.get_error_health_status()
    assert health["recent_error_count"] == 1 and "disk full" in health["message"]


def test_a_bad_call_in_a_batch_does_not_lose_the_rest():
    tracker = ActivityTracker({})
    token = tracker.start("m", "w")
    tracker.apply([("end", ("m:unknown",)), ("increment", ("n", 2)), ("end", (token,))])
    assert tracker.get_counters() == {"n": 2} and tracker.is_quiescent()
    tracker.apply([("start", ("m", "w", "m:mine")), ("end", ("m:mine",))])
    assert tracker.is_quiescent()
    with pytest.raises(ValueError, match="'clear_errors' cannot be queued"):
        tracker.apply([("clear_errors", ())])
