"""RayResourceManager / RayActorWrapper: colocation, rebinding, local resolution, restarts."""

from __future__ import annotations

import time

import pytest
from omegaconf import OmegaConf

from nexrl.distributed.recovery import ActorRestartedError
from nexrl.distributed.resource_manager import GroupOptions, RayResourceManager
from nexrl.distributed.settings import RaySettings, actor_env
from nexrl.execute import ModuleDiedError, execute, execute_within
from nexrl.module import NexRLModule
from nexrl.monitoring import ActivityTracker
from nexrl.types import NexRLRole

pytestmark = pytest.mark.ray


class Counter(NexRLModule):
    """A tiny stateful module: enough to see where calls land."""

    def __init__(self, start: int) -> None:
        super().__init__()
        self.value = start

    def add(self, n: int = 1) -> int:
        self.value += n
        return self.value

    def pid(self) -> int:
        import os

        return os.getpid()

    def peer_kind(self, peer) -> str:
        return type(peer).__name__

    def call_peer_add(self, peer, n: int) -> int:
        return execute(peer.add, n)

    def __len__(self) -> int:
        return self.value


def build_counter(cfg) -> Counter:
    return Counter(int(cfg.start))


def make_manager(layout: dict[str, str | None], tracker=None, **options) -> RayResourceManager:
    cfg = OmegaConf.create({"start": 10})
    manager = RayResourceManager(
        {g: GroupOptions(**options) for g in set(layout.values()) if g},
        env_vars=actor_env(RaySettings()),
        tracker=tracker,
    )
    for role, group in layout.items():
        manager.register_role(role, build_counter, cfg, 2 if role == "rollout_worker" else 1, group)
    manager.create_all_actors()
    return manager


@pytest.fixture(scope="module")
def manager(ray_local):
    layout = {"rollout_worker": "rollout", "weight_sync_controller": "rollout", "validator": None}
    manager = make_manager(layout)
    yield manager
    manager.kill_all()


def test_colocated_roles_share_one_actor_and_calls_reach_their_own_module(manager):
    w0, w1 = manager.get_actor_wrapper(NexRLRole.ROLLOUT_WORKER)
    (wsc,) = manager.get_actor_wrapper("weight_sync_controller")
    (solo,) = manager.get_actor_wrapper(NexRLRole.VALIDATOR)
    assert len(manager.actors) == 2
    assert execute(w0.pid) == execute(w1.pid) == execute(wsc.pid) != execute(solo.pid)
    assert execute(w0.add, 5) == 15  # role-prefixed: each module keeps its own state
    assert execute(w1.add) == 11
    assert execute(wsc.__len__) == 10
    assert (w0.is_colocated, solo.is_colocated) == (True, False)
    with pytest.raises(TypeError, match="execute"):
        w0.add(1)  # a wrapper method is not a local call


def test_a_wrapper_sent_to_its_own_actor_is_the_module_itself(manager):
    w0, w1 = manager.get_actor_wrapper("rollout_worker")
    (other,) = manager.get_actor_wrapper("validator")
    before = execute(other.__len__)
    assert execute(w0.peer_kind, w1) == "Counter"  # same actor: a direct call
    assert execute(w0.peer_kind, other) == "RayActorWrapper"
    assert execute(w0.call_peer_add, other, 3) == before + 3  # across actors, via execute
    assert execute(other.__len__) == before + 3


def test_unknown_role_and_duplicate_registration_name_the_role(ray_local):
    manager = RayResourceManager()
    manager.register_role("validator", build_counter, OmegaConf.create({"start": 0}), 1)
    with pytest.raises(ValueError, match="'validator' is already registered"):
        manager.register_role("validator", build_counter, OmegaConf.create({"start": 0}), 1)
    with pytest.raises(KeyError, match="'train_worker' has no actors"):
        manager.get_actor_wrapper(NexRLRole.TRAIN_WORKER)


def test_a_killed_actor_fails_calls_and_health_checks_within_the_timeout(ray_local):
    import ray

    manager = make_manager({"validator": "data"})
    tracker = ActivityTracker()
    (module,) = manager.get_actor_wrapper("validator")
    tracker.register_module("validator", module)
    assert tracker.check_module_liveness(timeout=5.0)
    ray.kill(manager.actors["data"], no_restart=True)
    t0 = time.monotonic()
    with pytest.raises(ModuleDiedError, match=r"validator_0\.add: the Ray actor"):
        while time.monotonic() - t0 < 30:
            execute_within(5.0, module.add, 1)
    assert not tracker.check_module_liveness(timeout=5.0)
    assert tracker.get_dead_modules() == ["validator"]
    assert time.monotonic() - t0 < 30  # bounded, not the 600 s default


def test_a_restarted_actor_replays_its_setup_and_drops_lost_work(ray_local):
    import ray

    tracker = ray.remote(ActivityTracker).options(num_cpus=0, max_concurrency=8).remote()
    manager = make_manager({"validator": "data"}, max_restarts=1, tracker=tracker)
    (module,) = manager.get_actor_wrapper("validator")
    execute(module.set_module_name, "validator")
    execute(module.add, 5)  # state, not journaled: lost on restart
    execute(tracker.start, "validator", "work the crash will lose")
    old_pid = execute(module.pid)
    ray.kill(manager.actors["data"], no_restart=False)
    deadline = time.monotonic() + 60
    with pytest.raises(ActorRestartedError, match="'data' \\(validator_0\\) restarted"):
        while time.monotonic() < deadline:  # retried on the restarted actor, which is fenced
            execute_within(60, module.pid)
            time.sleep(0.05)
    assert manager.restarted() == {"data": ["validator_0"]}
    assert manager.restarted() == {}  # each restart is reported once
    assert execute(module.get_module_name) == "validator"  # through the fence; replayed
    manager.unfence(["data"])
    assert execute(module.pid) != old_pid
    assert execute(module.__len__) == 10  # rebuilt from the config
    assert execute(tracker.is_quiescent)
    manager.kill_all()
    ray.kill(tracker)
