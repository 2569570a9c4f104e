"""`RaySystem`: the modules of a run as Ray actors (`launch_mode: ray`).

Same attributes and methods as `nexrl.system.LocalSystem`, with `RayActorWrapper`s
in place of module objects, so the controller (the Ray driver) runs unchanged.
Default layout, one actor per colocation group (`ray.colocation` overrides it):

    data     data_loader, validate_dataloader, trajectory_pool, train_batch_pool, validator
    train    train_worker(s), algorithm_processor
    rollout  rollout_worker(s), weight_sync_controller   (share the in-process engine)

plus one ActivityTracker actor that every module reaches through its
`ActivityTrackerProxy`. With the built-in in-process inference engine the rollout
workers and the weight-sync controller MUST share an actor (the engine is
process-wide per model tag); this is checked at start.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf, open_dict
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from nexrl.builders import BUILDERS, inference_config
from nexrl.config.schema import RayConfig
from nexrl.distributed.execute import execute, set_default_timeout
from nexrl.distributed.resource_manager import GroupOptions, RayResourceManager, runtime_env_for
from nexrl.distributed.virtual_cluster import RayVirtualCluster
from nexrl.monitoring import ActivityTracker, ActivityTrackerProxy
from nexrl.system import LocalSystem
from nexrl.types import NexRLRole

logger = logging.getLogger(__name__)

DEFAULT_COLOCATION: dict[str, str | None] = {
    NexRLRole.DATA_LOADER.value: "data",
    NexRLRole.VALIDATE_DATALOADER.value: "data",
    NexRLRole.TRAJECTORY_POOL.value: "data",
    NexRLRole.TRAIN_BATCH_POOL.value: "data",
    NexRLRole.VALIDATOR.value: "data",
    NexRLRole.TRAIN_WORKER.value: "train",
    NexRLRole.ALGORITHM_PROCESSOR.value: "train",
    NexRLRole.ROLLOUT_WORKER.value: "rollout",
    NexRLRole.WEIGHT_SYNC_CONTROLLER.value: "rollout",
}
IN_PROCESS_BACKENDS = ("builtin", "hf")


@dataclass
class RaySettings(RayConfig):
    """The `ray.*` section (schema: `nexrl.config.schema.RayConfig`, docs/ray.md) with the
    colocation layout resolved over `DEFAULT_COLOCATION`."""

    colocation: dict[str, str | None] = field(default_factory=lambda: dict(DEFAULT_COLOCATION))

    @classmethod
    def from_config(cls, config: DictConfig) -> RaySettings:
        section = OmegaConf.select(config, "ray", default=None)
        raw = OmegaConf.to_container(section, resolve=True) if section is not None else {}
        unknown = sorted(set(raw) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"unknown ray key(s) {unknown}; valid: {sorted(cls.__dataclass_fields__)}"
            )
        raw = {k: v for k, v in raw.items() if v is not None}
        colocation = {**DEFAULT_COLOCATION, **(raw.pop("colocation", None) or {})}
        bad = sorted(set(colocation) - {r.value for r in NexRLRole})
        if bad:
            raise ValueError(
                f"ray.colocation: unknown role(s) {bad}; roles: {[r.value for r in NexRLRole]}"
            )
        return cls(**raw, colocation=colocation)

    def group_options(self) -> dict[str, GroupOptions]:
        names = {g for g in self.colocation.values() if g} | set(self.groups)
        base = {"max_concurrency": self.max_concurrency, "max_restarts": self.max_restarts}
        out = {}
        for name in names:
            opts = {**base, **(self.groups.get(name) or {})}
            unknown = sorted(set(opts) - set(GroupOptions.__dataclass_fields__))
            if unknown:
                raise ValueError(f"ray.groups.{name}: unknown key(s) {unknown}")
            out[name] = GroupOptions(**opts)
        return out


def init_ray(settings: RaySettings) -> bool:
    """`ray.init` unless already connected; True when this call started/connected Ray."""
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"namespace": settings.namespace}
    if settings.address:  # joining a cluster: its resources are set by `ray start`
        kwargs["address"] = settings.address
    else:
        kwargs.update(
            num_cpus=settings.num_cpus, num_gpus=settings.num_gpus, include_dashboard=False
        )
    ray.init(**kwargs, runtime_env={"env_vars": actor_env(settings)})
    return True


def actor_env(settings: RaySettings) -> dict[str, str]:
    """What actors inherit from the driver: NEXRL_* variables, the import path, timeouts."""
    env = {k: v for k, v in os.environ.items() if k.startswith(("NEXRL_", "HF_"))}
    paths = [os.getcwd(), *[p for p in sys.path if p and os.path.isdir(p)]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["NEXRL_EXECUTE_TIMEOUT_S"] = str(settings.execute_timeout_s)
    return env


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


def build_ray_train_worker(cfg: DictConfig) -> Any:
    """TRAIN_WORKER in Ray mode: a data-parallel worker group when `ray.train_ranks` asks."""
    from nexrl.distributed.dp_train import build_ray_train_worker as build

    return build(cfg)


def start_inference_replicas(
    cfg: DictConfig, settings: RaySettings, env: dict[str, str]
) -> tuple[RayVirtualCluster, list[Any], DictConfig]:
    """Replica actors on their own bundles; returns the cluster, the actors and `cfg` with
    `service.inference_service.engine.replica_actors` naming them (the client's hook)."""
    from nexrl.inference.replicas import InferenceReplica

    layout = dict(settings.inference_replicas)
    cpus, gpus = (
        float(layout.get("num_cpus_per_bundle", 1.0)),
        float(layout.get("num_gpus_per_bundle", 0.0)),
    )
    cluster = RayVirtualCluster(
        layout["bundles_per_node"],
        use_gpus=gpus > 0,
        num_gpus_per_bundle=gpus or 1.0,
        num_cpus_per_bundle=cpus,
        name="nexrl-inference",
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
        actors.append(ray.remote(InferenceReplica).options(**options).remote(engine_config))
    ray.get([a.health.remote() for a in actors])
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.service.inference_service.engine.replica_actors = names
    return cluster, actors, cfg


class RaySystem:
    """Every module in a Ray actor; the driver holds wrappers (see module docstring)."""

    def __init__(self, cfg: DictConfig) -> None:
        self.settings = RaySettings.from_config(cfg)
        self._owns_ray = init_ray(self.settings)
        set_default_timeout(self.settings.execute_timeout_s)
        env = actor_env(self.settings)
        self.replica_cluster: RayVirtualCluster | None = None
        self.replicas: list[Any] = []
        if self.settings.inference_replicas.get("bundles_per_node"):
            self.replica_cluster, self.replicas, cfg = start_inference_replicas(
                cfg, self.settings, env
            )
        check_layout(cfg, self.settings.colocation)
        self.activity_tracker = (
            ray.remote(ActivityTracker)
            .options(
                num_cpus=0,
                max_concurrency=self.settings.max_concurrency,
                runtime_env=runtime_env_for(env),
            )
            .remote(cfg)
        )
        self.resource_manager = RayResourceManager(
            self.settings.group_options(), env_vars=env, tracker=self.activity_tracker
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
        self._bind_wrappers()
        self._name_and_track(ActivityTrackerProxy(self.activity_tracker))
        LocalSystem._wire(self)  # the same wiring calls, through execute

    def _bind_wrappers(self) -> None:
        def one(role: NexRLRole) -> Any:
            return self.resource_manager.get_actor_wrapper(role)[0]

        self.dataloader = one(NexRLRole.DATA_LOADER)
        self.validate_dataloader = one(NexRLRole.VALIDATE_DATALOADER)
        self.trajectory_pool = one(NexRLRole.TRAJECTORY_POOL)
        self.train_batch_pool = one(NexRLRole.TRAIN_BATCH_POOL)
        self.algorithm_processor = one(NexRLRole.ALGORITHM_PROCESSOR)
        self.weight_sync_controller = one(NexRLRole.WEIGHT_SYNC_CONTROLLER)
        self.validator = one(NexRLRole.VALIDATOR)
        self.train_workers = list(self.resource_manager.get_actor_wrapper(NexRLRole.TRAIN_WORKER))
        self.rollout_workers = list(
            self.resource_manager.get_actor_wrapper(NexRLRole.ROLLOUT_WORKER)
        )

    def _name_and_track(self, proxy: ActivityTrackerProxy) -> None:
        for name, module, is_rollout in LocalSystem._named(self):  # type: ignore[arg-type]
            execute(module.set_module_name, name)
            execute(module.set_activity_tracker, proxy)
            execute(self.activity_tracker.register_module, name, module, is_rollout)

    def start(self) -> None:
        LocalSystem.start(self)  # type: ignore[arg-type]

    def stop(self) -> None:
        """Stop the module loops; the actors stay up until `shutdown()`."""
        for module in reversed(self._loops()):
            execute(module.stop)

    def _loops(self) -> list[Any]:
        return LocalSystem._loops(self)  # type: ignore[arg-type]

    def shutdown(self) -> None:
        """Kill every actor of this run (and Ray itself if this system started it)."""
        self.resource_manager.kill_all()
        ray.kill(self.activity_tracker, no_restart=True)
        for replica in self.replicas:
            ray.kill(replica, no_restart=True)
        if self.replica_cluster is not None:
            self.replica_cluster.shutdown()
        if self._owns_ray:
            ray.shutdown()
