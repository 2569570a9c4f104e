"""Sync-mode weight sync: admission holds rollouts while a batch trains and validates."""

from nexrl.config.schema import TrajectoryPoolConfig, WeightConfig
from nexrl.data import InMemoryDataLoader
from nexrl.inference.protocol import WeightUpdateMeta
from nexrl.monitoring import ActivityTracker, ActivityTrackerProxy
from nexrl.pools import TrajectoryPool
from nexrl.types import StepResult
from tests.rollout_parts import build_task_owner


class RecordingInferenceClient:
    """Stands in for the inference side: records the weight pushes it receives."""

    def __init__(self):
        self.updates: list[WeightUpdateMeta] = []

    def update_weights(self, meta):
        self.updates.append(meta)


class Parts:
    """The task owner, the weight pusher and a pool, wired as in a run."""

    def __init__(self, validate_freq=0, last_step=0):
        self.client = RecordingInferenceClient()
        weight = WeightConfig(sync_mode="sync", validate_freq=validate_freq)
        self.tasks, self.wsc = build_task_owner(
            weight, self.client, "/tmp/sync", gpb=2, last_step=last_step
        )
        loader = InMemoryDataLoader({}, items=[{"prompt": f"p{i}"} for i in range(10)])
        self.pool = TrajectoryPool(TrajectoryPoolConfig(batch_size=4, group_size=2))
        tracker = ActivityTrackerProxy(ActivityTracker({}))
        for m in (self.tasks, self.wsc, self.pool, loader):
            m.set_activity_tracker(tracker)
        self.pool.set_module_references(loader, self.tasks)
        self.tasks.set_module_references(loader, InMemoryDataLoader({}, items=[{"prompt": "v"}]))


def make(validate_freq=0, last_step=0):
    parts = Parts(validate_freq, last_step)
    return parts.tasks, parts.wsc, parts.pool, parts.client


def land(tasks, pool):
    task = tasks.acquire("default")
    traj = {"uid": task.uid, "task_id": task.task_id, "model_version": 0, "model_tag": "default"}
    traj.update(prompt_ids=[1], response_ids=[2], response_logprobs=[0.0], reward=1.0)
    assert pool.put_trajectory_group([dict(traj), dict(traj)]) == StepResult.SUCCESS
    tasks.complete("default", task, StepResult.SUCCESS)


def form_batch(tasks, pool):
    """The batch's two groups land and the trainer takes it."""
    land(tasks, pool)
    land(tasks, pool)
    assert pool.get_batch() is not None


def test_full_batch_blocks_rollouts_until_weights_are_pushed():
    tasks, wsc, pool, client = make()
    land(tasks, pool)
    land(tasks, pool)
    assert tasks.acquire("default") is None  # one batch admitted: nothing more starts
    assert pool.get_batch() is not None
    assert tasks.acquire("default") is None  # the batch trains
    wsc.train_worker_notify_weight_update("train_worker_0", "default")
    assert [u.version for u in client.updates] == [1]
    assert client.updates[0].path == "/tmp/sync"
    assert wsc.get_rollout_model_version("default") == 1
    assert tasks.acquire("default") is not None


def test_validation_holds_training_admission_until_it_ends():
    tasks, wsc, pool, _ = make(validate_freq=1)
    form_batch(tasks, pool)
    wsc.train_worker_notify_weight_update("train_worker_0", "default")
    assert wsc.is_waiting_for_validation()
    assert tasks.acquire("default") is None  # training data waits for the validation
    wsc.start_validate("default")
    task = tasks.acquire("default")
    assert task.is_validate  # validation tasks pass
    wsc.end_validate("default")
    assert not wsc.is_waiting_for_validation()
    assert not tasks.acquire("default").is_validate


def test_a_due_validation_holds_admission_before_the_push_lands():
    """A worker waiting for the push must not slip a training task in between the new
    version and the validation: the validation would share the engine with that batch."""
    tasks, wsc, pool, _ = make(validate_freq=1)
    form_batch(tasks, pool)
    slipped = []
    set_version = tasks.set_version

    def then_a_worker_asks(tag, version):  # the moment the new version admits rollouts
        set_version(tag, version)
        slipped.append(tasks.acquire("default"))

    tasks.set_version = then_a_worker_asks
    wsc.train_worker_notify_weight_update("train_worker_0", "default")
    assert slipped == [None]
    assert wsc.is_waiting_for_validation()


def test_no_training_task_is_admitted_after_the_last_step():
    tasks, wsc, pool, client = make(last_step=1)
    form_batch(tasks, pool)
    wsc.train_worker_notify_weight_update("train_worker_0", "default")
    assert [u.version for u in client.updates] == [1]  # the final weights still serve
    assert tasks.acquire("default") is None  # nothing more will be trained
    wsc.start_validate("default")
    assert tasks.acquire("default").is_validate  # the final validation runs
    wsc.end_validate("default")
    assert tasks.acquire("default") is None


def test_versions_are_per_model_tag():
    _, wsc, _, client = make()
    wsc.sync_weight_to_rollout_service("a")
    wsc.sync_weight_to_rollout_service("a")
    wsc.sync_weight_to_rollout_service("b")
    assert wsc.get_rollout_model_version("a") == 2
    assert wsc.get_rollout_model_version("b") == 1
    assert [u.version for u in client.updates] == [1, 2, 1]


def test_wait_for_progress_returns_when_a_step_is_notified_or_times_out():
    import threading
    import time

    tasks, wsc, pool, _ = make(validate_freq=1)
    t0 = time.monotonic()
    assert wsc.wait_for_progress(0, 0.05) == 0  # nothing trained: the timeout
    assert time.monotonic() - t0 >= 0.05
    land(tasks, pool)
    land(tasks, pool)
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


def public_methods(cls) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n))}


def test_the_weight_pusher_and_the_task_owner_have_one_job_each():
    """Weights and versions on one side, tasks on the other: the weight-sync controller
    keeps at most 12 methods of its own, its Protocol matches it, and no task method of
    `TaskAdmission` is reachable through it (workers and the pool call admission)."""
    import inspect

    from nexrl.module import NexRLModule
    from nexrl.protocols import TaskAdmissionLike, WeightSyncLike
    from nexrl.rollout.admission import TaskAdmission
    from nexrl.weight_sync import WeightSyncController

    # seed 000's name, kept for code written against it (a no-op); not in the Protocol
    seed_aliases = {"trajectory_pool_notify_batch_ready"}
    own = public_methods(WeightSyncController) - public_methods(NexRLModule)
    protocol = public_methods(WeightSyncLike) - public_methods(NexRLModule)
    assert seed_aliases <= own and not seed_aliases & protocol
    assert len(own - seed_aliases) <= 12 and len(protocol) <= 12
    assert protocol <= own
    for name in protocol:  # same parameters in the Protocol and the class
        expected = inspect.signature(getattr(WeightSyncLike, name)).parameters
        assert list(inspect.signature(getattr(WeightSyncController, name)).parameters) == list(
            expected
        ), name
    task_methods = public_methods(TaskAdmission) - public_methods(NexRLModule)
    assert not own & (task_methods - {"reset", "set_module_references"})
    tasks, wsc, _, _ = make()
    assert isinstance(wsc, WeightSyncLike) and isinstance(tasks, TaskAdmissionLike)
