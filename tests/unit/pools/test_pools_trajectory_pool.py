"""TrajectoryPool: batches of whole groups per model tag, one `form_batch` call per batch."""

from __future__ import annotations

import threading
import time

import pytest

from nexrl.config.schema import TrainBatchPoolConfig, TrajectoryPoolConfig
from nexrl.data import InMemoryDataLoader
from nexrl.monitoring import ActivityTracker, ActivityTrackerProxy
from nexrl.pools import TrainBatchPool, TrajectoryPool
from nexrl.rollout.admission import BatchPlan
from nexrl.types import Batch


class RecordingTaskOwner:
    """Stand-in task owner: records each `form_batch` call and marks the groups whose
    oldest version is below `min_version` as stale."""

    def __init__(self, min_version: int = 0) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.min_version = min_version
        self.formed = 0

    def form_batch(self, model_tag, groups, need):
        self.calls.append((model_tag, len(groups), need))
        stale = [i for i, g in enumerate(groups) if (g.min_version or 0) < self.min_version]
        fresh = [i for i in range(len(groups)) if i not in stale]
        take = (fresh[:need] if need else fresh) if len(fresh) >= max(need, 1) else []
        index = None
        if take:
            index, self.formed = self.formed, self.formed + 1
        return BatchPlan(index=index, take=take, stale=stale)

    def end_of_data(self, model_tag):
        return True  # every handed-out task has arrived (the loader and tracker decide)

    def drop_groups(self, model_tag, groups, reason):
        self.calls.append((model_tag, len(groups), reason))
        return len(groups)


def traj(uid: str, i: int = 0, **kw) -> dict:
    base = {"uid": uid, "i": i, "reward": float(i), "prompt_ids": [1], "response_ids": [2]}
    return {**base, "response_logprobs": [0.0], **kw}


def group(uid: str, n: int, **kw) -> list[dict]:
    return [traj(uid, i, **kw) for i in range(n)]


def make_pool(**cfg) -> tuple[TrajectoryPool, RecordingTaskOwner]:
    pool = TrajectoryPool(TrajectoryPoolConfig(batch_size=4, group_size=2, **cfg))
    wsc = RecordingTaskOwner()
    # data left in the loader: not the end of the data, so short batches wait
    pool.set_module_references(InMemoryDataLoader(items=[{"prompt": "x"}]), wsc)
    return pool, wsc


def test_batch_of_whole_groups_and_one_form_batch_call_per_batch() -> None:
    pool, wsc = make_pool()
    assert pool.put_trajectory_group(group("a", 2)) == "success"
    assert pool.get_batch() is None and wsc.calls == []  # not enough: no call at all
    pool.put_trajectory_group(group("b", 2))
    pool.put_trajectory_group(group("c", 2))
    batch = pool.get_batch()
    assert batch.values["uid"] == ["a", "a", "b", "b"] and batch.metadata["batch_index"] == 0
    assert wsc.calls == [("default", 3, 2)]  # all ready groups, two needed
    assert pool.num_ready() == 2


def test_stale_groups_are_discarded_and_counted_in_the_batch() -> None:
    pool, wsc = make_pool()
    wsc.min_version = 1
    pool.put_trajectory_group(group("old", 2, model_version=0))
    pool.put_trajectory_group(group("b", 2, model_version=1))
    assert pool.get_batch() is None  # one fresh group: no batch, the stale one is gone
    pool.put_trajectory_group(group("c", 2, model_version=1))
    batch = pool.get_batch()
    assert batch.values["uid"] == ["b", "b", "c", "c"]
    assert pool.is_empty()


def test_model_tags_have_separate_stores() -> None:
    pool, _ = make_pool()
    pool.put_trajectory_group(group("a", 2, model_tag="x"))
    pool.put_trajectory_group(group("b", 2, model_tag="y"))
    assert pool.get_batch(model_tag="x") is None
    pool.put_trajectory_group(group("c", 2, model_tag="x"))
    assert pool.get_batch(model_tag="x").values["uid"] == ["a", "a", "c", "c"]
    assert sorted(pool.get_model_tags()) == ["x", "y"]


def test_malformed_trajectory_fails_naming_the_key_and_is_reported() -> None:
    pool, _ = make_pool()
    tracker = ActivityTracker({})
    pool.set_activity_tracker(ActivityTrackerProxy(tracker))
    assert pool.put_trajectory_group([traj("a"), {**traj("a"), "uid": None}]) == "fail"
    assert pool.put_trajectory_group([traj("a"), traj("a", model_tag="x")]) == "fail"
    no_ids = {k: v for k, v in traj("a").items() if k != "response_ids"}
    assert pool.put_trajectory_group([no_ids, traj("a")]) == "fail"
    assert pool.is_empty()
    assert tracker.get_error_health_status()["warning_level_count"] == 3
    messages = [e.message for e in tracker.error_reporter.get_errors()]
    assert "'uid'" in messages[0] and "several model tags" in messages[1]
    assert "response_ids" in messages[2]


def test_loaded_batch_finished_releases_the_tail() -> None:
    loader = InMemoryDataLoader(items=[{"prompt": "a"}])
    tracker = ActivityTracker({})
    tracker.register_module("rollout_0", object(), is_rollout_worker=True)
    pool = TrajectoryPool(
        TrajectoryPoolConfig(
            batch_size=4, group_size=2, check_batch_ready_function="loaded_batch_finished"
        )
    )
    wsc = RecordingTaskOwner()
    pool.set_activity_tracker(ActivityTrackerProxy(tracker))
    pool.set_module_references(loader, wsc)
    pool.put_trajectory_group(group("a", 2))
    assert pool.get_batch() is None  # loader not finished
    loader.get_next_item()
    token = tracker.start("rollout_0", "step")
    assert not pool.is_batch_ready()  # a worker is still busy
    tracker.end(token)
    pool.put_trajectory(traj("b"))  # an incomplete group stays out of the tail
    assert pool.is_batch_ready()
    batch = pool.get_batch()
    assert len(batch) == 2 and batch.values["uid"] == ["a", "a"]
    assert wsc.calls == [("default", 1, 0)]  # need 0: the tail takes what is ready
    assert pool.get_batch() is None and [t["uid"] for t in pool.drain_incomplete()] == ["b"]


def test_the_last_group_arriving_during_the_end_of_data_check_makes_a_full_batch() -> None:
    """The pool reads its ready groups, then asks whether the data has ended; the last
    group may arrive in between (then the answer is yes). It must form the full batch,
    not drop the groups it read as a tail."""
    loader = InMemoryDataLoader(items=[])
    pool = TrajectoryPool(TrajectoryPoolConfig(batch_size=4, group_size=2))
    wsc = RecordingTaskOwner()

    def last_group_arrives(model_tag):
        pool.put_trajectory_group(group("b", 2))
        return True

    wsc.end_of_data = last_group_arrives
    pool.set_module_references(loader, wsc)
    pool.put_trajectory_group(group("a", 2))
    batch = pool.get_batch()
    assert batch is not None and batch.values["uid"] == ["a", "a", "b", "b"]
    assert all(reason != "end_of_data" for *_, reason in wsc.calls)  # nothing dropped


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match="multiple of trajectory_pool.group_size"):
        TrajectoryPool(TrajectoryPoolConfig(batch_size=6, group_size=4))
    with pytest.raises(ValueError, match="check_batch_ready_function.*valid choices"):
        TrajectoryPool(TrajectoryPoolConfig(batch_size=4, check_batch_ready_function="soon"))
    simple = TrajectoryPool(TrajectoryPoolConfig(batch_size=3, group_size=4, key_list=[]))
    for i in range(3):
        simple.put_trajectory(traj("x", i))
    assert simple.get_batch().values["i"] == [0, 1, 2]


def test_train_batch_pool_fifo_per_model_tag() -> None:
    pool = TrainBatchPool(TrainBatchPoolConfig(max_size=2))
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


def test_a_waiting_get_batch_outlasts_groups_that_do_not_complete_a_batch() -> None:
    """One waiting call per batch: groups that leave it short do not end the wait."""
    pool, _ = make_pool()  # batches of 4: two groups of 2
    got: list[Batch | None] = []
    waiter = threading.Thread(target=lambda: got.append(pool.get_batch(wait_s=30)))
    waiter.start()
    pool.put_trajectory_group(group("a", 2))
    time.sleep(0.1)
    assert waiter.is_alive() and not got
    pool.put_trajectory_group(group("b", 2))
    waiter.join(5)
    assert not waiter.is_alive() and len(got[0]) == 4


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
