"""Sync-mode weight sync: admission holds rollouts while a batch trains and validates."""

from nexrl.config.schema import TrajectoryPoolConfig, WeightConfig
from nexrl.data import InMemoryDataLoader
from nexrl.inference.protocol import WeightUpdateMeta
from nexrl.monitoring import ActivityTracker, ActivityTrackerProxy
from nexrl.pools import TrajectoryPool
from nexrl.types import StepResult
from nexrl.weight_sync import WeightSyncController


class RecordingInferenceClient:
    """Stands in for the inference side: records the weight pushes it receives."""

    def __init__(self):
        self.updates: list[WeightUpdateMeta] = []

    def update_weights(self, meta):
        self.updates.append(meta)


def make(validate_freq=0, last_step=0):
    client = RecordingInferenceClient()
    wsc = WeightSyncController(
        WeightConfig(sync_mode="sync", validate_freq=validate_freq),
        client,
        "/tmp/sync",
        groups_per_batch=2,
        max_task_retries=0,
        last_step=last_step,
    )
    loader = InMemoryDataLoader({}, items=[{"prompt": f"p{i}"} for i in range(10)])
    pool = TrajectoryPool(TrajectoryPoolConfig(batch_size=4, group_size=2))
    tracker = ActivityTrackerProxy(ActivityTracker({}))
    for m in (wsc, pool, loader):
        m.set_activity_tracker(tracker)
    pool.set_module_references(loader, wsc)
    wsc.set_module_references(loader, pool, InMemoryDataLoader({}, items=[{"prompt": "v"}]))
    return wsc, pool, client


def land(wsc, pool):
    task = wsc.acquire_task("default")
    traj = {"uid": task.uid, "task_id": task.task_id, "model_version": 0, "model_tag": "default"}
    traj.update(prompt_ids=[1], response_ids=[2], response_logprobs=[0.0], reward=1.0)
    assert pool.put_trajectory_group([dict(traj), dict(traj)]) == "success"
    wsc.complete_task("default", task, StepResult.SUCCESS)


def form_batch(wsc, pool):
    """The batch's two groups land and the trainer takes it."""
    land(wsc, pool)
    land(wsc, pool)
    assert pool.get_batch() is not None


def test_full_batch_blocks_rollouts_until_weights_are_pushed():
    wsc, pool, client = make()
    land(wsc, pool)
    land(wsc, pool)
    assert wsc.acquire_task("default") is None  # one batch admitted: nothing more starts
    assert pool.get_batch() is not None
    assert wsc.acquire_task("default") is None  # the batch trains
    wsc.train_worker_notify_weight_update("train_worker_0", "default")
    assert [u.version for u in client.updates] == [1]
    assert client.updates[0].path == "/tmp/sync"
    assert wsc.get_rollout_model_version("default") == 1
    assert wsc.acquire_task("default") is not None


def test_validation_holds_training_admission_until_it_ends():
    wsc, pool, _ = make(validate_freq=1)
    form_batch(wsc, pool)
    wsc.train_worker_notify_weight_update("train_worker_0", "default")
    assert wsc.is_waiting_for_validation()
    assert wsc.acquire_task("default") is None  # training data waits for the validation
    wsc.start_validate("default")
    task = wsc.acquire_task("default")
    assert task.is_validate  # validation tasks pass
    wsc.end_validate("default")
    assert not wsc.is_waiting_for_validation()
    assert not wsc.acquire_task("default").is_validate


def test_a_due_validation_holds_admission_before_the_push_lands():
    """A worker waiting for the push must not slip a training task in between the new
    version and the validation: the validation would share the engine with that batch."""
    wsc, pool, _ = make(validate_freq=1)
    form_batch(wsc, pool)
    slipped = []
    set_version = wsc.admission.set_version

    def then_a_worker_asks(tag, version):  # the moment the new version admits rollouts
        set_version(tag, version)
        slipped.append(wsc.acquire_task("default"))

    wsc.admission.set_version = then_a_worker_asks
    wsc.train_worker_notify_weight_update("train_worker_0", "default")
    assert slipped == [None]
    assert wsc.is_waiting_for_validation()


def test_no_training_task_is_admitted_after_the_last_step():
    wsc, pool, client = make(last_step=1)
    form_batch(wsc, pool)
    wsc.train_worker_notify_weight_update("train_worker_0", "default")
    assert [u.version for u in client.updates] == [1]  # the final weights still serve
    assert wsc.acquire_task("default") is None  # nothing more will be trained
    wsc.start_validate("default")
    assert wsc.acquire_task("default").is_validate  # the final validation runs
    wsc.end_validate("default")
    assert wsc.acquire_task("default") is None


def test_versions_are_per_model_tag():
    wsc, _, client = make()
    wsc.sync_weight_to_rollout_service("a")
    wsc.sync_weight_to_rollout_service("a")
    wsc.sync_weight_to_rollout_service("b")
    assert wsc.get_rollout_model_version("a") == 2
    assert wsc.get_rollout_model_version("b") == 1
    assert [u.version for u in client.updates] == [1, 2, 1]


def test_wait_for_progress_returns_when_a_step_is_notified_or_times_out():
    import threading
    import time

    wsc, pool, _ = make(validate_freq=1)
    t0 = time.monotonic()
    assert wsc.wait_for_progress(0, 0.05) == 0  # nothing trained: the timeout
    assert time.monotonic() - t0 >= 0.05
    land(wsc, pool)
    land(wsc, pool)
    assert pool.get_batch() is not None
    seen: list[int] = []
    waiter = threading.Thread(target=lambda: seen.append(wsc.wait_for_progress(0, 30.0)))
    waiter.start()
    time.sleep(0.05)
    assert not seen  # still waiting: no step has ended
    wsc.train_worker_notify_weight_update("train_worker_0", "default")
    waiter.join(timeout=5.0)
    assert seen == [1]  # woken by the step, long before the 30 s timeout
    assert wsc.is_waiting_for_validation()  # flagged before the waiter woke
    assert wsc.wait_for_progress(5, 30.0) == 1  # a count it has not seen (a rewind): at once
