"""WeightSyncController in the async modes, against the real pool and loader."""

import threading
import time

from nexrl.config.schema import TrajectoryPoolConfig, WeightConfig
from nexrl.data import InMemoryDataLoader
from nexrl.monitoring import ActivityTracker, ActivityTrackerProxy
from nexrl.pools import TrajectoryPool
from nexrl.types import StepResult, Task
from tests.rollout_parts import build_task_owner


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
    cfg = WeightConfig(sync_mode=mode, staleness_threshold=k, **extra)
    owner, wsc = build_task_owner(cfg, client, "/tmp/sync", gpb=gpb)
    loader = InMemoryDataLoader({}, items=[{"prompt": f"p{i}"} for i in range(20)])
    pool = TrajectoryPool(TrajectoryPoolConfig(batch_size=2 * gpb, group_size=2))
    tracker = ActivityTracker({})
    for m in (owner, wsc, pool, loader):
        m.set_activity_tracker(ActivityTrackerProxy(tracker))
    pool.set_module_references(loader, owner)
    owner.set_module_references(loader)
    return owner, wsc, pool, loader, client, tracker


def group(task: Task, version):
    return [
        {
            "uid": task.uid,
            "task_id": task.task_id,
            "prompt_ids": [1],
            "response_ids": [2],
            "response_logprobs": [0.0],
            "model_version": version,
            "token_versions": [version],
            "model_tag": "default",
        }
        for _ in range(2)
    ]


def land(owner, pool, version):
    """A worker's whole step: acquire a task, put its group, report success."""
    task = owner.acquire("default")
    assert task is not None
    pool.put_trajectory_group(group(task, version))
    owner.complete("default", task, StepResult.SUCCESS)
    return task


def test_sync_mode_admits_exactly_one_batch_until_the_push():
    owner, wsc, pool, loader, client, _ = make(mode="sync", k=5)
    tasks = [owner.acquire("default") for _ in range(3)]
    assert tasks[2] is None and None not in tasks[:2]
    for task in tasks[:2]:
        pool.put_trajectory_group(group(task, 0))
        owner.complete("default", task, StepResult.SUCCESS)
    assert pool.get_batch().metadata["batch_index"] == 0
    assert owner.acquire("default") is None  # batch 0 trains: nothing new starts
    wsc.train_worker_notify_weight_update("train_worker_0", "default")
    assert client.calls == ["update:1"]
    assert owner.acquire("default") is not None


def test_batch_async_push_waits_for_running_rollouts():
    owner, wsc, _, _, client, _ = make()
    running = owner.acquire("default")  # a rollout runs on version 0
    assert running is not None
    pusher = threading.Thread(
        target=wsc.train_worker_notify_weight_update, args=("train_worker_0", "default")
    )
    pusher.start()
    time.sleep(0.1)
    assert client.calls == []  # still running on the old weights
    assert owner.acquire("default") is None  # new rollouts wait for the push
    assert wsc.check_rollout_service_status("default") == "continue"  # running ones go on
    owner.complete("default", running, StepResult.DROPPED)
    pusher.join(5)
    assert client.calls == ["update:1"] and wsc.get_rollout_model_version("default") == 1
    assert owner.acquire("default") is not None


def test_fully_async_push_aborts_running_requests_under_a_block():
    owner, wsc, _, _, client, _ = make(mode="fully-async", inflight_weight_update=False)
    seen = {}
    client.on_abort = lambda: seen.update(
        status=wsc.check_rollout_service_status("default"),
        admit=owner.acquire("default") is not None,
    )
    assert owner.acquire("default") is not None  # running requests do not delay the push
    wsc.train_worker_notify_weight_update("train_worker_0", "default")
    assert client.calls == ["pause", "abort", "update:1", "resume"]
    assert seen == {"status": "block", "admit": False}
    assert wsc.check_rollout_service_status("default") == "continue"


def test_sync_every_pushes_every_n_steps_and_versions_count_steps():
    owner, wsc, _, _, client, _ = make(sync_every=2)  # batch-async, nothing running
    wsc.train_worker_notify_weight_update("train_worker_0", "default")
    assert client.calls == [] and wsc.get_rollout_model_version("default") == 0
    wsc.train_worker_notify_weight_update("train_worker_0", "default")
    assert client.calls == ["update:2"]


def test_tail_candidates_are_served_together_before_new_data():
    owner, wsc, _, _, _, tracker = make(mode="fully-async", tail_batch_trigger_size=2)
    late = [owner.acquire("default") for _ in range(2)]
    owner.complete("default", late[0], StepResult.DEFERRED)
    assert owner.snapshot("default")["tail_candidates"] == 1
    assert owner.acquire("default").data["prompt"] == "p2"  # not served yet
    owner.complete("default", late[1], StepResult.DEFERRED)
    first, second = owner.acquire("default"), owner.acquire("default")
    assert [first.data["prompt"], second.data["prompt"]] == ["p0", "p1"]
    assert first.tail and second.tail
    counters = tracker.get_counters()
    assert counters["tail_batch/served"] == 2 and counters["tail_batch/batches"] == 1


def test_stale_group_is_dropped_and_its_task_served_first():
    owner, wsc, pool, loader, _, tracker = make(
        mode="fully-async", k=0, gpb=1, over_sample_threshold=1.0
    )
    old, late = owner.acquire("default"), owner.acquire("default")  # one over-sent
    pool.put_trajectory_group(group(old, 0))
    owner.complete("default", old, StepResult.SUCCESS)
    assert pool.get_batch().metadata["batch_index"] == 0
    wsc.train_worker_notify_weight_update("train_worker_0", "default")  # version 1
    pool.put_trajectory_group(group(late, 0))  # started on version 0: staleness 1 > 0
    owner.complete("default", late, StepResult.SUCCESS)
    fresh = land(owner, pool, 1)
    batch = pool.get_batch()
    assert batch.values["uid"] == [fresh.uid] * 2
    assert batch.metadata["batch_index"] == 1 and batch.metadata["staleness_dropped"] == 1
    again = loader.get_next_item()  # re-queued at the front, with its bookkeeping
    assert isinstance(again, Task) and again.uid == late.uid
    assert tracker.get_counters()["staleness/dropped"] == 1


def test_a_waiting_acquire_is_woken_by_the_change_that_admits_it():
    owner, wsc, pool, loader, client, _ = make(mode="sync", k=5)
    tasks = [owner.acquire("default") for _ in range(2)]
    start = time.monotonic()
    assert owner.acquire("default", wait_s=0.1) is None  # nothing changes: refused on time
    assert 0.1 <= time.monotonic() - start < 2
    for task in tasks:
        pool.put_trajectory_group(group(task, 0))
        owner.complete("default", task, StepResult.SUCCESS)
    pool.get_batch()
    admitted = []
    waiter = threading.Thread(
        target=lambda: admitted.append(owner.acquire("default", 30) is not None)
    )
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive() and not admitted  # batch 0 trains: the worker waits
    start = time.monotonic()
    wsc.train_worker_notify_weight_update("train_worker_0", "default")  # push: admits again
    waiter.join(5)
    assert admitted == [True] and time.monotonic() - start < 5


def test_validation_tasks_need_no_admission():
    owner, wsc, pool, loader, client, _ = make(mode="sync", k=5)
    validate = InMemoryDataLoader({}, items=[{"prompt": "v0"}])
    owner.set_module_references(loader, validate)
    assert [owner.acquire("default") is not None for _ in range(3)] == [True, True, False]
    wsc.start_validate("default")
    task = owner.acquire("default")
    assert task.is_validate and task.data["prompt"] == "v0"
    assert owner.acquire("default") is None  # validation set done; training still full


def test_failed_task_is_retried_then_counted_and_its_slot_released():
    owner, wsc, pool, loader, _, tracker = make(mode="sync", k=5, gpb=1)
    owner.max_task_retries = 1
    task = owner.acquire("default")
    owner.complete("default", task, StepResult.FAIL)
    again = owner.acquire("default")  # the slot came back; the task is served first
    assert again.task_id == task.task_id and again.retries == 1
    owner.complete("default", again, StepResult.FAIL)
    counters = tracker.get_counters()
    assert counters["tasks_failed/train"] == 1 and counters["tasks_in/train"] == 1
    assert owner.acquire("default").data["prompt"] == "p1"
