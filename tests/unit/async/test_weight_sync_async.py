"""WeightSyncController in the async modes, against the real pool and loader."""

import threading
import time

from nexrl.data import InMemoryDataLoader
from nexrl.monitoring import ActivityTracker, ActivityTrackerProxy
from nexrl.pools import TrajectoryPool
from nexrl.weight_sync import TAIL_KEY, WeightSyncController


class RecordingInference:
    """Stands in for the inference side: records control calls in order."""

    def __init__(self):
        self.calls: list[str] = []
        self.on_abort = None

    def update_weights(self, meta):
        self.calls.append(f"update:{meta.version}")

    def pause(self):
        self.calls.append("pause")

    def abort(self, rid=None):
        self.calls.append("abort")
        if self.on_abort:
            self.on_abort()

    def resume(self):
        self.calls.append("resume")


def make(mode="batch-async", k=1, gpb=2, **extra):
    client = RecordingInference()
    cfg = {"sync_mode": mode, "staleness_threshold": k, "groups_per_batch": gpb, **extra}
    wsc = WeightSyncController(cfg, client, "/tmp/sync")
    loader = InMemoryDataLoader({}, items=[{"prompt": f"p{i}"} for i in range(20)])
    pool = TrajectoryPool({"batch_size": 2 * gpb, "group_size": 2, "key_list": ["uid"]})
    tracker = ActivityTracker({})
    for m in (wsc, pool, loader):
        m.set_activity_tracker(ActivityTrackerProxy(tracker))
    pool.set_module_references(loader, wsc)
    wsc.set_module_references(loader, pool)
    return wsc, pool, loader, client, tracker


def group(task, version):
    return [
        {
            "uid": task["uid"],
            "model_version": version,
            "token_versions": [version],
            "model_tag": "default",
            "_nexrl_task": task,
        }
        for _ in range(2)
    ]


def test_sync_mode_admits_exactly_one_batch_until_the_push():
    wsc, pool, loader, client, _ = make(mode="sync", k=5)
    assert [wsc.acquire_rollout("default") for _ in range(3)] == [True, True, False]
    for _ in range(2):
        pool.put_trajectory_group(group(loader.get_next_item(), 0))
    assert pool.get_batch().metadata["batch_index"] == 0
    assert not wsc.acquire_rollout("default")  # batch 0 trains: nothing new starts
    wsc.train_worker_notify_weight_update("train_worker_0", "default")
    assert client.calls == ["update:1"]
    assert wsc.acquire_rollout("default")


def test_batch_async_push_waits_for_running_rollouts():
    wsc, _, _, client, _ = make()
    assert wsc.acquire_rollout("default")  # a rollout runs on version 0
    pusher = threading.Thread(
        target=wsc.train_worker_notify_weight_update, args=("train_worker_0", "default")
    )
    pusher.start()
    time.sleep(0.1)
    assert client.calls == []  # still running on the old weights
    assert not wsc.acquire_rollout("default")  # new rollouts wait for the push
    assert wsc.check_rollout_service_status("default") == "continue"  # running ones go on
    wsc.finish_generation("default")
    pusher.join(5)
    assert client.calls == ["update:1"] and wsc.get_rollout_model_version("default") == 1
    assert wsc.acquire_rollout("default")


def test_fully_async_push_aborts_running_requests_under_a_block():
    wsc, _, _, client, _ = make(mode="fully-async")
    seen = {}
    client.on_abort = lambda: seen.update(
        status=wsc.check_rollout_service_status("default"), admit=wsc.acquire_rollout("default")
    )
    assert wsc.acquire_rollout("default")  # running requests do not delay the push
    wsc.train_worker_notify_weight_update("train_worker_0", "default")
    assert client.calls == ["pause", "abort", "update:1", "resume"]
    assert seen == {"status": "block", "admit": False}
    assert wsc.check_rollout_service_status("default") == "continue"


def test_sync_every_pushes_every_n_steps_and_versions_count_steps():
    wsc, _, _, client, _ = make(sync_every=2)  # batch-async, nothing running
    wsc.train_worker_notify_weight_update("train_worker_0", "default")
    assert client.calls == [] and wsc.get_rollout_model_version("default") == 0
    wsc.train_worker_notify_weight_update("train_worker_0", "default")
    assert client.calls == ["update:2"]


def test_tail_candidates_are_served_together_before_new_data():
    wsc, _, loader, _, tracker = make(mode="fully-async", tail_batch_trigger_size=2)
    wsc.add_tail_candidate("default", {"prompt": "late-1"})
    assert wsc.get_admission_state()["tail_candidates"] == 1
    assert loader.get_next_item()["prompt"] == "p0"  # not served yet
    wsc.add_tail_candidate("default", {"prompt": "late-2"})
    first, second = loader.get_next_item(), loader.get_next_item()
    assert [first["prompt"], second["prompt"]] == ["late-1", "late-2"]
    assert first[TAIL_KEY] and second[TAIL_KEY]
    counters = tracker.get_counters()
    assert counters["tail_batch/served"] == 2 and counters["tail_batch/batches"] == 1


def test_stale_group_is_dropped_and_its_task_served_first():
    wsc, pool, loader, _, tracker = make(k=0, gpb=1, over_sample_threshold=1.0)
    old = loader.get_next_item()
    for _ in range(2):  # one over-sent group
        assert wsc.acquire_rollout("default")
        wsc.finish_generation("default")
    pool.put_trajectory_group(group(old, 0))
    assert pool.get_batch().metadata["batch_index"] == 0
    wsc.train_worker_notify_weight_update("train_worker_0", "default")  # version 1
    late = loader.get_next_item()
    pool.put_trajectory_group(group(late, 0))  # started on version 0: staleness 1 > 0
    fresh = loader.get_next_item()
    pool.put_trajectory_group(group(fresh, 1))
    batch = pool.get_batch()
    assert batch.values["uid"] == [fresh["uid"]] * 2
    assert batch.metadata["batch_index"] == 1 and batch.metadata["staleness_dropped"] == 1
    assert loader.get_next_item()["uid"] == late["uid"]  # re-queued at the front
    assert tracker.get_counters()["staleness/dropped"] == 1


def test_a_waiting_acquire_is_woken_by_the_change_that_admits_it():
    wsc, pool, loader, client, _ = make(mode="sync", k=5)
    assert [wsc.acquire_rollout("default") for _ in range(2)] == [True, True]
    start = time.monotonic()
    assert not wsc.acquire_rollout("default", wait_s=0.1)  # nothing changes: refused on time
    assert 0.1 <= time.monotonic() - start < 2
    for _ in range(2):
        pool.put_trajectory_group(group(loader.get_next_item(), 0))
    pool.get_batch()
    admitted = []
    waiter = threading.Thread(target=lambda: admitted.append(wsc.acquire_rollout("default", 30)))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive() and not admitted  # batch 0 trains: the worker waits
    start = time.monotonic()
    wsc.train_worker_notify_weight_update("train_worker_0", "default")  # push: admits again
    waiter.join(5)
    assert admitted == [True] and time.monotonic() - start < 5


def test_a_waiting_acquire_gives_way_to_validation():
    wsc, *_ = make(mode="sync", k=5)
    assert [wsc.acquire_rollout("default") for _ in range(2)] == [True, True]
    refused = []
    waiter = threading.Thread(target=lambda: refused.append(wsc.acquire_rollout("default", 30)))
    waiter.start()
    time.sleep(0.1)
    wsc.start_validate("default")
    waiter.join(5)
    assert refused == [False]  # the worker goes back to its loop and runs validation tasks
