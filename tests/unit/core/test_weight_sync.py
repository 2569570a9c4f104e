"""Sync-mode weight sync against the real TrajectoryPool."""

from nexrl.inference.protocol import WeightUpdateMeta
from nexrl.monitoring import ActivityTracker, ActivityTrackerProxy
from nexrl.pools import TrajectoryPool
from nexrl.weight_sync import WeightSyncController


class RecordingInferenceClient:
    """Stands in for the inference side: records the weight pushes it receives."""

    def __init__(self):
        self.updates: list[WeightUpdateMeta] = []

    def update_weights(self, meta):
        self.updates.append(meta)


def group(uid, n=2):
    return [{"uid": uid, "reward": float(i), "model_tag": "default"} for i in range(n)]


def make(validate_freq=0):
    client = RecordingInferenceClient()
    wsc = WeightSyncController(
        {"sync_mode": "sync", "validate_freq": validate_freq}, client, "/tmp/sync"
    )
    pool = TrajectoryPool({"batch_size": 4, "group_size": 2, "key_list": ["uid"]})
    tracker = ActivityTrackerProxy(ActivityTracker({}))
    for m in (wsc, pool):
        m.set_activity_tracker(tracker)
    pool.set_module_references(None, wsc)
    wsc.set_module_references(None, pool)
    return wsc, pool, client


def test_full_batch_blocks_rollouts_until_weights_are_pushed():
    wsc, pool, client = make()
    assert pool.put_trajectory_group(group("a")) == "success"
    assert wsc.check_rollout_service_status("default") == "continue"
    assert pool.put_trajectory_group(group("b")) == "success"  # batch ready -> lock
    assert wsc.check_rollout_service_status("default") == "block"
    assert pool.put_trajectory_group(group("c")) == "re-rollout"
    assert pool.get_batch() is not None
    wsc.train_worker_notify_weight_update("train_worker_0", "default")
    assert [u.version for u in client.updates] == [1]
    assert client.updates[0].path == "/tmp/sync"
    assert wsc.get_rollout_model_version("default") == 1
    assert wsc.check_rollout_service_status("default") == "continue"
    assert pool.put_trajectory_group(group("c")) == "success"


def test_validation_holds_the_lock_until_it_ends():
    wsc, pool, _ = make(validate_freq=1)
    pool.put_trajectory_group(group("a"))
    pool.put_trajectory_group(group("b"))
    pool.get_batch()
    wsc.train_worker_notify_weight_update("train_worker_0", "default")
    assert wsc.is_waiting_for_validation()
    assert wsc.check_rollout_service_status("default") == "block"
    wsc.start_validate("default")
    assert wsc.check_rollout_service_status("default") == "continue"  # validation requests pass
    assert pool.put_trajectory_group(group("x")) == "re-rollout"  # but training data waits
    wsc.end_validate("default")
    assert not wsc.is_waiting_for_validation()
    assert wsc.check_rollout_service_status("default") == "continue"
    assert pool.put_trajectory_group(group("x")) == "success"


def test_versions_are_per_model_tag():
    wsc, _, client = make()
    wsc.sync_weight_to_rollout_service("a")
    wsc.sync_weight_to_rollout_service("a")
    wsc.sync_weight_to_rollout_service("b")
    assert wsc.get_rollout_model_version("a") == 2
    assert wsc.get_rollout_model_version("b") == 1
    assert [u.version for u in client.updates] == [1, 2, 1]
