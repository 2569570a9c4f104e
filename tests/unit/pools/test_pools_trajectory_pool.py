"""TrajectoryPool: batches of whole groups per model tag, weight-sync gate, notifications."""

from __future__ import annotations

import threading

import pytest

from nexrl.data import InMemoryDataLoader
from nexrl.monitoring import ActivityTracker, ActivityTrackerProxy
from nexrl.pools import TrainBatchPool, TrajectoryPool
from nexrl.types import Batch


class RecordingWeightSync:
    """Stand-in weight sync controller: records batch-ready notifications, and can
    lock the pool from inside the callback like the sync-mode controller does."""

    def __init__(self, pool: TrajectoryPool | None = None) -> None:
        self.ready: list[str] = []
        self.pool = pool

    def trajectory_pool_notify_batch_ready(self, model_tag: str) -> None:
        self.ready.append(model_tag)
        if self.pool is not None:
            self.pool.notify_weight_sync_starting(model_tag)


def group(uid: str, n: int, **kw) -> list[dict]:
    return [{"uid": uid, "i": i, "reward": float(i), **kw} for i in range(n)]


def make_pool(**cfg) -> tuple[TrajectoryPool, RecordingWeightSync]:
    pool = TrajectoryPool({"batch_size": 4, "group_size": 2, **cfg})
    wsc = RecordingWeightSync()
    pool.set_module_references(InMemoryDataLoader(items=[]), wsc)
    return pool, wsc


def test_batch_of_whole_groups_and_one_notification_per_batch() -> None:
    pool, wsc = make_pool()
    for t in group("a", 2) + group("b", 1):
        assert pool.put_trajectory(t) == "success"
    assert pool.get_batch() is None and wsc.ready == []  # 2 ready, b incomplete
    assert pool.put_trajectory(group("b", 2)[1]) == "success"
    assert wsc.ready == ["default"]
    for uid in "cd":
        pool.put_trajectory_group(group(uid, 2))
    assert wsc.ready == ["default", "default"]  # one per ready batch
    batch = pool.get_batch()
    assert isinstance(batch, Batch) and len(batch) == 4
    assert batch.values["uid"] == ["a", "a", "b", "b"]
    assert batch.metadata["model_tag"] == "default" and batch.metadata["group_size"] == 2
    assert pool.num_ready() == 4 and not pool.is_empty()
    assert len(pool.get_batch()) == 4 and pool.is_empty() and pool.get_batch() is None


def test_model_tags_have_separate_stores() -> None:
    pool, wsc = make_pool()
    pool.put_trajectory_group(group("a", 2, model_tag="actor"))
    pool.put_trajectory_group(group("b", 2, model_tag="actor"))
    pool.put_trajectory_group(group("c", 2))
    assert sorted(pool.get_model_tags()) == ["actor", "default"]
    assert wsc.ready == ["actor"]
    assert pool.get_batch(model_tag="default") is None
    assert pool.get_batch(model_tag="missing") is None
    batch = pool.get_batch()  # any tag with enough samples
    assert batch.metadata["model_tag"] == "actor"
    assert pool.is_empty("actor") and not pool.is_empty()
    assert len(pool.get_batch(batch_size=2, model_tag="default")) == 2
    with pytest.raises(ValueError, match="multiple of group_size"):
        pool.get_batch(batch_size=3)


def test_weight_sync_lock_refuses_whole_groups_then_unlocks() -> None:
    pool, wsc = make_pool()
    pool.notify_weight_sync_starting()  # no tag: all tags, even ones not seen yet
    assert pool.put_trajectory_group(group("a", 2)) == "re-rollout"
    assert pool.put_trajectory({"uid": "z", "model_tag": "new"}) == "re-rollout"
    assert pool.is_empty()
    pool.unlock_for_weight_sync()
    assert pool.put_trajectory_group(group("a", 2)) == "success"
    pool.notify_weight_sync_starting("default")
    assert pool.put_trajectory({"uid": "b"}) == "re-rollout"
    assert pool.put_trajectory({"uid": "b", "model_tag": "other"}) == "success"


def test_lock_taken_during_notification_never_splits_a_group() -> None:
    """The sync controller locks the pool when a batch becomes ready; concurrent group
    puts are then accepted or refused whole, so every held group stays complete."""
    pool = TrajectoryPool({"batch_size": 4, "group_size": 4})
    wsc = RecordingWeightSync(pool)
    pool.set_module_references(None, wsc)
    results: dict[str, str] = {}

    def worker(k: int) -> None:
        for j in range(5):
            uid = f"w{k}-{j}"
            results[uid] = pool.put_trajectory_group(group(uid, 4))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    accepted = [u for u, r in results.items() if r == "success"]
    assert set(results.values()) == {"success", "re-rollout"}  # the lock did close
    assert pool.drain_incomplete() == []  # no group was split
    assert pool.num_ready() == 4 * len(accepted)
    assert wsc.ready == ["default"] * len(accepted)
    held = pool.get_batch(batch_size=4 * len(accepted)).values["uid"]
    assert sorted(held) == sorted(u for u in accepted for _ in range(4))


def test_missing_key_fails_and_is_reported() -> None:
    pool, _ = make_pool()
    tracker = ActivityTracker({})
    pool.set_activity_tracker(ActivityTrackerProxy(tracker))
    assert pool.put_trajectory_group([{"uid": "a"}, {"i": 1}]) == "fail"
    assert pool.put_trajectory_group([{"uid": "a"}, {"uid": "a", "model_tag": "x"}]) == "fail"
    assert pool.is_empty()
    assert tracker.get_error_health_status()["warning_level_count"] == 2
    messages = [e.message for e in tracker.error_reporter.get_errors()]
    assert "no grouping key 'uid'" in messages[0] and "several model tags" in messages[1]


def test_loaded_batch_finished_releases_the_tail() -> None:
    loader = InMemoryDataLoader(items=[{"prompt": "a"}])
    tracker = ActivityTracker({})
    tracker.register_module("rollout_0", object(), is_rollout_worker=True)
    pool = TrajectoryPool(
        {"batch_size": 4, "group_size": 2, "check_batch_ready_function": "loaded_batch_finished"}
    )
    wsc = RecordingWeightSync()
    pool.set_activity_tracker(ActivityTrackerProxy(tracker))
    pool.set_module_references(loader, wsc)
    pool.put_trajectory_group(group("a", 2))
    assert pool.get_batch() is None  # loader not finished
    loader.get_next_item()
    token = tracker.start("rollout_0", "step")
    assert not pool.is_batch_ready()  # a worker is still busy
    tracker.end(token)
    pool.put_trajectory({"uid": "b"})  # an incomplete group stays out of the tail
    assert pool.is_batch_ready() and wsc.ready == ["default"]
    batch = pool.get_batch()
    assert len(batch) == 2 and batch.values["uid"] == ["a", "a"]
    assert pool.get_batch() is None and [t["uid"] for t in pool.drain_incomplete()] == ["b"]


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        TrajectoryPool({"group_size": 2})
    with pytest.raises(ValueError, match="multiple of trajectory_pool.group_size"):
        TrajectoryPool({"batch_size": 6, "group_size": 4})
    with pytest.raises(ValueError, match="check_batch_ready_function.*valid choices"):
        TrajectoryPool({"batch_size": 4, "check_batch_ready_function": "soon"})
    simple = TrajectoryPool({"batch_size": 3, "group_size": 4, "key_list": []})
    for i in range(3):
        simple.put_trajectory({"i": i})
    assert simple.get_batch().values["i"] == [0, 1, 2]


def test_train_batch_pool_fifo_per_model_tag() -> None:
    pool = TrainBatchPool({"max_size": 2})
    b1 = Batch.from_trajectories([{"x": 1}], model_tag="default")
    b2 = Batch.from_trajectories([{"x": 2}], model_tag="default")
    b3 = Batch.from_trajectories([{"x": 3}], model_tag="critic")
    assert pool.put_batch(b1, "policy") and pool.put_batch(b2, "policy")
    assert not pool.put_batch(Batch.from_trajectories([{"x": 9}]), "policy")  # full
    assert pool.put_batch(b3, "value")
    assert pool.qsize() == 3 and pool.qsize("critic") == 1
    first = pool.get_batch()
    assert first.values["x"] == [1] and first.metadata["update_fn"] == "policy"
    assert pool.get_batch("critic").metadata["update_fn"] == "value"
    assert pool.get_batch("critic") is None
    assert pool.get_batch(None).values["x"] == [2]
    assert pool.is_empty()


def test_waiting_get_batch_is_woken_by_the_group_that_completes_a_batch() -> None:
    pool, _ = make_pool()
    pool.put_trajectory_group(group("a", 2))
    assert pool.get_batch(wait_s=0.05) is None  # nothing arrives: None after the wait
    got: list[Batch | None] = []
    waiter = threading.Thread(target=lambda: got.append(pool.get_batch(wait_s=30)))
    waiter.start()
    pool.put_trajectory_group(group("b", 2))
    waiter.join(5)
    assert not waiter.is_alive() and got[0] is not None and len(got[0]) == 4


def test_waiting_train_batch_pool_get_is_woken_by_put() -> None:
    pool = TrainBatchPool()
    assert pool.get_batch("default", wait_s=0.05) is None
    got: list[Batch | None] = []
    waiter = threading.Thread(target=lambda: got.append(pool.get_batch("default", wait_s=30)))
    waiter.start()
    batch = Batch.from_trajectories(group("a", 2), model_tag="default", group_size=2)
    assert pool.put_batch(batch)
    waiter.join(5)
    assert not waiter.is_alive() and got == [batch]
