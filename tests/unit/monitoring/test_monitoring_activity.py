"""ActivityTracker: in-flight work, quiescence, liveness, counters; the proxy's track()."""

from __future__ import annotations

import json
import threading

import pytest

from nexrl.module import NexRLModule
from nexrl.monitoring import ActivityTracker, ActivityTrackerProxy


class Healthy(NexRLModule):
    pass


class Broken(NexRLModule):
    def health_check(self) -> bool:
        raise RuntimeError("thread died")


class Unhealthy(NexRLModule):
    def health_check(self) -> bool:
        return False


def test_start_end_quiescence_and_summary() -> None:
    tracker = ActivityTracker({})
    assert tracker.is_quiescent() and "quiescent" in tracker.get_running_status_summary()
    t1 = tracker.start("rollout_0", "step")
    t2 = tracker.start("train_worker", "train_step")
    assert t1 != t2 and not tracker.is_quiescent()
    summary = tracker.get_running_status_summary()
    assert "2 work item(s)" in summary and "rollout_0: step" in summary
    tracker.end(t1)
    tracker.end(t2)
    assert tracker.is_quiescent()
    with pytest.raises(ValueError, match="unknown or already ended"):
        tracker.end(t1)


def test_wait_quiescent_times_out_then_wakes_on_end() -> None:
    tracker = ActivityTracker({})
    token = tracker.start("m", "w")
    assert tracker.wait_quiescent(timeout=0.01) is False
    timer = threading.Timer(0.05, tracker.end, args=(token,))
    timer.start()
    assert tracker.wait_quiescent(timeout=10.0) is True
    timer.join()


def test_rollout_worker_quiescence_only_counts_rollout_workers() -> None:
    tracker = ActivityTracker({})
    tracker.register_module("rollout_0", Healthy(), is_rollout_worker=True)
    tracker.register_module("train_worker", Healthy())
    busy_trainer = tracker.start("train_worker", "train")
    assert tracker.is_rollout_worker_quiescent() and not tracker.is_quiescent()
    busy_rollout = tracker.start("rollout_0", "step")
    assert not tracker.is_rollout_worker_quiescent()
    tracker.end(busy_rollout)
    tracker.end(busy_trainer)
    assert tracker.is_rollout_worker_quiescent()


def test_liveness_raising_or_false_health_check_is_dead() -> None:
    tracker = ActivityTracker({})
    tracker.register_module("ok", Healthy())
    assert tracker.check_module_liveness() is True and tracker.get_dead_modules() == []
    tracker.register_module("broken", Broken())
    tracker.register_module("sick", Unhealthy())
    assert tracker.check_module_liveness(timeout=1.0) is False
    assert tracker.get_dead_modules() == ["broken", "sick"]


def test_proxy_track_reports_and_reraises() -> None:
    tracker = ActivityTracker({})
    proxy = ActivityTrackerProxy(tracker)
    seen_inflight = []
    with proxy.track("rollout_0", "step"):
        seen_inflight.append(tracker.is_quiescent())
    assert seen_inflight == [False] and tracker.is_quiescent()
    with pytest.raises(KeyError, match="answer"), proxy.track("rollout_0", "reward"):
        raise KeyError("answer")
    assert tracker.is_quiescent()  # ended even on error
    assert tracker.get_error_health_status()["status"] == "error"
    assert tracker.error_reporter.get_errors()[0].work_context == "reward"
    with pytest.raises(ZeroDivisionError), proxy.track("m", "w", auto_report_errors=False):
        _ = 1 / 0
    assert tracker.get_error_health_status()["error_level_count"] == 1


def test_counters_and_training_step_through_proxy_are_thread_safe() -> None:
    tracker = ActivityTracker({})
    proxy = ActivityTrackerProxy(tracker)

    def bump() -> None:
        for _ in range(500):
            proxy.increment("tasks_failed")

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    proxy.increment("rewards_failed", 3)
    assert proxy.get_counters() == {"tasks_failed": 2000, "rewards_failed": 3}
    proxy.set_training_step(7)
    assert proxy.get_training_step() == 7 == tracker.get_training_step()


def test_experiment_logger_post_defaults_step_to_training_step(tmp_path) -> None:
    tracker = ActivityTracker({"logger": {"run_dir": str(tmp_path), "backend": []}})
    proxy = ActivityTrackerProxy(tracker)
    proxy.set_training_step(3)
    proxy.experiment_logger_post(backend="metrics", data={"reward": 0.5})
    proxy.experiment_logger_post(backend="metrics", data={"val/reward": 0.75}, step=4)
    tracker.close()
    lines = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(x["step"], x.get("reward"), x.get("val/reward")) for x in lines] == [
        (3, 0.5, None),
        (4, None, 0.75),
    ]
