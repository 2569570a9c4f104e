"""The set of running modules, built and wired for one launch mode.

`ModuleSystem` holds the modules of a run and wires them; `LocalSystem` builds
every module in this process, `nexrl.distributed.ray_system.RaySystem` builds
them as Ray actors and holds wrappers with the same methods. The controller
cannot tell the two apart because it only talks to modules through `execute`;
it picks one by `launch_mode` (`nexrl.controller.build_system`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from omegaconf import DictConfig

from nexrl.builders import (
    build_algorithm_processor,
    build_dataloader,
    build_rollout_worker,
    build_task_admission,
    build_train_batch_pool,
    build_train_worker,
    build_trajectory_pool,
    build_validate_dataloader,
    build_validator,
    build_weight_sync_controller,
)
from nexrl.execute import execute
from nexrl.monitoring import ActivityTracker, ActivityTrackerProxy
from nexrl.protocols import (
    DataLoaderLike,
    LoopModuleLike,
    ModuleLike,
    ProcessorLike,
    RolloutWorkerLike,
    TaskAdmissionLike,
    TrainBatchPoolLike,
    TrainWorkerLike,
    TrajectoryPoolLike,
    ValidatorLike,
    WeightSyncLike,
)

R = TypeVar("R")


class ModuleSystem:
    """The modules of one run (objects or actor wrappers, typed by their Protocol: an actor
    wrapper has the module's methods) and how they are wired."""

    activity_tracker: ActivityTracker  # Ray: its actor handle (same methods, via `execute`)
    dataloader: DataLoaderLike
    validate_dataloader: DataLoaderLike
    trajectory_pool: TrajectoryPoolLike
    train_batch_pool: TrainBatchPoolLike
    algorithm_processor: ProcessorLike
    weight_sync_controller: WeightSyncLike
    task_admission: TaskAdmissionLike
    validator: ValidatorLike
    train_workers: list[TrainWorkerLike]
    rollout_workers: list[RolloutWorkerLike]
    watch_interval_s: float = 0.02
    """Pause between the controller's polls while it waits for a validation to end."""
    progress_wait_s: float = 0.02
    """Longest wait of the controller's watch loop between two passes; a finished train
    step ends the wait at once (`WeightSyncController.wait_for_progress`)."""

    def named_modules(self) -> list[tuple[str, ModuleLike, bool]]:
        """(name, module, is_rollout_worker) for every module."""
        mods: list[tuple[str, ModuleLike, bool]] = [
            ("data_loader", self.dataloader, False),
            ("validate_dataloader", self.validate_dataloader, False),
            ("trajectory_pool", self.trajectory_pool, False),
            ("train_batch_pool", self.train_batch_pool, False),
            ("algorithm_processor", self.algorithm_processor, False),
            ("weight_sync_controller", self.weight_sync_controller, False),
            ("task_admission", self.task_admission, False),
            ("validator", self.validator, False),
        ]
        mods += [(f"train_worker_{i}", w, False) for i, w in enumerate(self.train_workers)]
        mods += [(f"rollout_worker_{i}", w, True) for i, w in enumerate(self.rollout_workers)]
        return mods

    def name_and_track(self, proxy: ActivityTrackerProxy) -> None:
        for name, module, is_rollout in self.named_modules():
            execute(module.set_module_name, name)
            execute(module.set_activity_tracker, proxy)
            execute(self.activity_tracker.register_module, name, module, is_rollout)

    def wire(self) -> None:
        """Give every module the references it calls (the arrows of docs/architecture.md)."""
        wsc, loader, pool = self.weight_sync_controller, self.dataloader, self.trajectory_pool
        tasks = self.task_admission
        execute(tasks.set_module_references, loader, self.validate_dataloader)
        execute(wsc.set_module_references, tasks)
        for worker in self.rollout_workers:
            execute(worker.set_module_references, pool, tasks, wsc, self.validator)
        execute(pool.set_module_references, loader, tasks)
        execute(
            self.algorithm_processor.set_module_references,
            pool,
            self.train_batch_pool,
            self.train_workers[0],
        )
        for trainer in self.train_workers:
            execute(trainer.set_module_references, self.train_batch_pool, wsc, loader, tasks)
        execute(self.validator.set_module_references, self.validate_dataloader)

    def restarted_actors(self, settle: bool = False) -> dict[str, list[str]]:
        """Actor group -> module keys, for Ray actors that restarted since the last call
        (`settle`: first wait for actors being restarted to come back)."""
        return {}

    def flush_tracker(self) -> None:
        """Every tracker call queued in any process has arrived (Ray: the module actors'
        outboxes; local mode calls the tracker directly)."""

    def on_checkpoint_node(self, fn: Callable[..., R], *args: Any) -> R:
        """`fn(*args)` on the machine whose disk holds the checkpoints (the train
        worker's; Ray: a task on its node, as there may be no shared disk)."""
        return fn(*args)

    def describe_failure(self) -> str | None:
        """Ray: which node(s) of the run left the cluster and what to do; None here."""
        return None

    def unfence(self, groups: list[str]) -> None:
        """Ray: calls reach the restarted actors of `groups` again (no actors here)."""

    def loops(self) -> list[LoopModuleLike]:
        return [*self.train_workers, self.algorithm_processor, *self.rollout_workers]

    def start(self) -> None:
        for module in self.loops():
            execute(module.run)

    def stop(self) -> None:
        for module in reversed(self.loops()):
            execute(module.stop)


class LocalSystem(ModuleSystem):
    """Every module in this process; loops run in threads."""

    def __init__(self, cfg: DictConfig) -> None:
        self.activity_tracker = ActivityTracker(cfg)
        self.dataloader = build_dataloader(cfg)
        self.validate_dataloader = build_validate_dataloader(cfg)
        self.trajectory_pool = build_trajectory_pool(cfg)
        self.train_batch_pool = build_train_batch_pool(cfg)
        self.algorithm_processor = build_algorithm_processor(cfg)
        self.weight_sync_controller = build_weight_sync_controller(cfg)
        self.task_admission = build_task_admission(cfg)
        self.validator = build_validator(cfg)
        self.train_workers = [build_train_worker(cfg) for _ in range(cfg.train_worker.num_workers)]
        self.rollout_workers = [
            build_rollout_worker(cfg) for _ in range(cfg.rollout_worker.num_workers)
        ]
        self.name_and_track(ActivityTrackerProxy(self.activity_tracker))
        self.wire()

    def stop(self) -> None:
        from nexrl.inference.client import shutdown_local_engines

        super().stop()
        # the in-process engines belong to this run: a later run in the same
        # process must start from its own weights and version 0
        shutdown_local_engines()
