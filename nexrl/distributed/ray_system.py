"""`RaySystem`: the modules of a run as Ray actors (`launch_mode: ray`).

Same attributes and methods as `nexrl.system.LocalSystem`, with `RayActorWrapper`s
in place of module objects, so the controller (the Ray driver) runs unchanged.
One actor per colocation group: by default (`ray.layout: one_actor`) every module in
a `main` actor; `rollout_train` splits it in two:

    rollout  rollout_worker(s), weight_sync_controller   (share the in-process engine),
             task_admission, data_loader, validate_dataloader, trajectory_pool, validator
    train    train_worker(s), algorithm_processor, train_batch_pool

(`ray.colocation` overrides single roles), plus one ActivityTracker actor that every
module reaches through its `ActivityTrackerProxy`. With the built-in in-process
inference engine the rollout workers and the weight-sync controller MUST share an
actor (the engine is process-wide per model tag); this is checked at start.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any, TypeVar, cast

import ray
from omegaconf import DictConfig, OmegaConf, open_dict
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from nexrl.builders import BUILDERS, inference_config
from nexrl.distributed.nodes import node_table, pinned_here, run_on_node, wait_for_lost_nodes
from nexrl.distributed.resource_manager import RayResourceManager, runtime_env_for
from nexrl.distributed.settings import IN_PROCESS_BACKENDS, RaySettings, actor_env, init_ray
from nexrl.distributed.virtual_cluster import RayVirtualCluster
from nexrl.execute import set_default_timeout
from nexrl.monitoring import ActivityTracker, ActivityTrackerProxy
from nexrl.protocols import (
    DataLoaderLike,
    ProcessorLike,
    RolloutWorkerLike,
    TaskAdmissionLike,
    TrainBatchPoolLike,
    TrainWorkerLike,
    TrajectoryPoolLike,
    ValidatorLike,
    WeightSyncLike,
)
from nexrl.system import ModuleSystem
from nexrl.types import NexRLRole

logger = logging.getLogger(__name__)
R = TypeVar("R")


def check_layout(cfg: DictConfig, colocation: dict[str, str | None]) -> None:
    """An in-process engine is only shared inside one actor: fail early with the fix."""
    backend = cfg.service.inference_service.backend
    if OmegaConf.select(cfg, "service.inference_service.engine.replica_actors", default=None):
        return  # every module reaches the same replica actors
    rollout = colocation.get(NexRLRole.ROLLOUT_WORKER.value)
    wsc = colocation.get(NexRLRole.WEIGHT_SYNC_CONTROLLER.value)
    if backend in IN_PROCESS_BACKENDS and (rollout is None or rollout != wsc):
        raise ValueError(
            f"service.inference_service.backend={backend!r} runs the engine inside the rollout "
            "actor, so ray.colocation.rollout_worker and ray.colocation.weight_sync_controller "
            f"must name the same group (got {rollout!r} and {wsc!r})"
        )


def build_ray_train_worker(cfg: DictConfig) -> TrainWorkerLike:
    """TRAIN_WORKER in Ray mode: a data-parallel worker group when `ray.train_ranks` asks."""
    from nexrl.distributed.dp_train import build_ray_train_worker as build

    return build(cfg)


def start_inference_replicas(
    cfg: DictConfig, settings: RaySettings, env: dict[str, str]
) -> tuple[RayVirtualCluster, list[Any], DictConfig]:
    """Replica actors on their own bundles; returns the cluster, the actors and `cfg` with
    `service.inference_service.engine.replica_actors` naming them (the client's hook)."""
    from nexrl.inference.replicas import InferenceReplica

    layout = settings.inference_replicas
    cpus, gpus = float(layout.num_cpus_per_bundle), float(layout.num_gpus_per_bundle)
    cluster = RayVirtualCluster(
        list(layout.bundles_per_node),
        use_gpus=gpus > 0,
        num_gpus_per_bundle=gpus or 1.0,
        num_cpus_per_bundle=cpus,
        name="nexrl-inference",
        node_resources=layout.node_resources,
    )
    engine_config = inference_config(cfg)
    prefix = f"nexrl-replica-{uuid.uuid4().hex[:8]}"
    names, actors = [], []
    for i, (pg, index) in enumerate(cluster.bundle_locations()):
        names.append(f"{prefix}-{i}")
        options = dict(
            name=names[-1],
            num_cpus=cpus,
            num_gpus=gpus,
            max_concurrency=settings.max_concurrency,
            max_restarts=settings.max_restarts,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, index),
            runtime_env=runtime_env_for(env),
        )
        replica: Any = ray.remote(InferenceReplica)  # an actor class (Ray's stubs say function)
        actors.append(replica.options(**options).remote(engine_config))
    ray.get([a.health.remote() for a in actors])
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.service.inference_service.engine.replica_actors = names
    return cluster, actors, cfg


class RaySystem(ModuleSystem):
    """Every module in a Ray actor; the driver holds wrappers (see module docstring).
    `stop()` stops the module loops; the actors stay up until `shutdown()`."""

    watch_interval_s = 0.1
    """Each poll of a running validation is a Ray call here."""
    progress_wait_s = 0.5
    """Each pass of the watch loop is three Ray calls (train step, loader, weight sync)
    and wakes the actors and this driver: polled every 0.1 s they were 7 calls a step of
    the default run; waiting for the step's end makes them 4, and a stall (end of data,
    a restarted actor) is seen within 0.5 s."""

    def __init__(self, cfg: DictConfig) -> None:
        self.settings = RaySettings.from_config(cfg)
        self._owns_ray = init_ray(self.settings)
        set_default_timeout(self.settings.execute_timeout_s)
        env = actor_env(self.settings)
        module_env = {**env, "OMP_NUM_THREADS": str(self.settings.module_threads())}
        self.replica_cluster: RayVirtualCluster | None = None
        self.replicas: list[Any] = []
        if self.settings.inference_replicas.bundles_per_node:
            self.replica_cluster, self.replicas, cfg = start_inference_replicas(
                cfg, self.settings, env
            )
        check_layout(cfg, self.settings.colocation)
        self._tracker_actor: Any = (  # Ray's stubs cannot tell an actor from its class
            ray.remote(ActivityTracker)
            .options(
                num_cpus=0,
                max_concurrency=self.settings.max_concurrency,
                runtime_env=runtime_env_for(env),
                scheduling_strategy=pinned_here(),  # the run dir's logs: the driver's disk
            )
            .remote(cfg)
        )
        # the actor handle has the tracker's methods (as Ray methods `execute` calls)
        self.activity_tracker = cast(ActivityTracker, self._tracker_actor)
        self.resource_manager = RayResourceManager(
            self.settings.group_options(), env_vars=module_env, tracker=self.activity_tracker
        )
        counts = {
            NexRLRole.TRAIN_WORKER: cfg.train_worker.num_workers,
            NexRLRole.ROLLOUT_WORKER: cfg.rollout_worker.num_workers,
        }
        builders = {**BUILDERS, NexRLRole.TRAIN_WORKER: build_ray_train_worker}
        for role, builder in builders.items():
            group = self.settings.colocation.get(role.value)
            self.resource_manager.register_role(role, builder, cfg, counts.get(role, 1), group)
        self.resource_manager.create_all_actors()
        self.checkpoint_path = str(cfg.train_worker.checkpoint_path)
        self.placement = self.resource_manager.placement()
        """Actor group -> the node it runs on (see `describe_failure`)."""
        self._nodes = node_table()
        self._train_group = self.resource_manager.group_of(NexRLRole.TRAIN_WORKER)
        self._bind_wrappers()
        self.name_and_track(ActivityTrackerProxy(self.activity_tracker))
        self.wire()  # the same wiring calls as local mode, through execute

    def _bind_wrappers(self) -> None:
        """Each role's actor wrapper, typed by the role's Protocol: a wrapper has the
        module's public methods (as Ray actor methods that `execute` calls)."""

        def all_of(role: NexRLRole) -> list[Any]:
            return list(self.resource_manager.get_actor_wrapper(role))

        def one(role: NexRLRole) -> Any:
            return all_of(role)[0]

        self.dataloader = cast(DataLoaderLike, one(NexRLRole.DATA_LOADER))
        self.validate_dataloader = cast(DataLoaderLike, one(NexRLRole.VALIDATE_DATALOADER))
        self.trajectory_pool = cast(TrajectoryPoolLike, one(NexRLRole.TRAJECTORY_POOL))
        self.train_batch_pool = cast(TrainBatchPoolLike, one(NexRLRole.TRAIN_BATCH_POOL))
        self.algorithm_processor = cast(ProcessorLike, one(NexRLRole.ALGORITHM_PROCESSOR))
        self.weight_sync_controller = cast(WeightSyncLike, one(NexRLRole.WEIGHT_SYNC_CONTROLLER))
        self.task_admission = cast(TaskAdmissionLike, one(NexRLRole.TASK_ADMISSION))
        self.validator = cast(ValidatorLike, one(NexRLRole.VALIDATOR))
        self.train_workers = cast(list[TrainWorkerLike], all_of(NexRLRole.TRAIN_WORKER))
        self.rollout_workers = cast(list[RolloutWorkerLike], all_of(NexRLRole.ROLLOUT_WORKER))

    def restarted_actors(self, settle: bool = False) -> dict[str, list[str]]:
        """Module actors that restarted since the last call; they stay fenced (calls raise
        `ActorRestartedError`) until `unfence` (nexrl/distributed/recovery.py). `settle`:
        first wait (up to `ray.execute_timeout_s`) for actors Ray is restarting."""
        return self.resource_manager.restarted(settle, self.settings.execute_timeout_s)

    def on_checkpoint_node(self, fn: Callable[..., R], *args: Any) -> R:
        """`fn(*args)` in a task on the train worker's node: its disk holds the checkpoints
        (nexrl/distributed/nodes.py)."""
        actor = self.resource_manager.actors[self._train_group]
        result: R = run_on_node(ray.get(actor.node_id.remote()), fn, *args)
        return result

    def describe_failure(self) -> str | None:
        """Which node(s) of this run left the cluster, and what to do; None if none did."""
        actors = self.resource_manager.actors
        return wait_for_lost_nodes(actors, self.placement, self.checkpoint_path, self._nodes)

    def flush_tracker(self) -> None:
        from nexrl.monitoring.outbox import flush_all

        flush_all(timeout=30.0)
        self.resource_manager.flush_tracker()

    def unfence(self, groups: list[str]) -> None:
        self.resource_manager.unfence(groups)

    def shutdown(self) -> None:
        """Kill every actor of this run (and Ray itself if this system started it)."""
        self.resource_manager.kill_all()
        ray.kill(self._tracker_actor, no_restart=True)
        for replica in self.replicas:
            ray.kill(replica, no_restart=True)
        if self.replica_cluster is not None:
            self.replica_cluster.shutdown()
        if self._owns_ray:
            ray.shutdown()
