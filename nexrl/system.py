"""The set of running modules, built and wired for one launch mode.

`ModuleSystem` holds the modules of a run and wires them; `LocalSystem` builds
every module in this process, `nexrl.distributed.ray_system.RaySystem` builds
them as Ray actors and holds wrappers with the same methods. The controller
cannot tell the two apart because it only talks to modules through `execute`;
it picks one by `launch_mode` (`nexrl.controller.build_system`).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from nexrl.builders import BUILDERS
from nexrl.execute import execute
from nexrl.monitoring import ActivityTracker, ActivityTrackerProxy
from nexrl.types import NexRLRole


class ModuleSystem:
    """The modules of one run (objects or actor wrappers) and how they are wired."""

    activity_tracker: Any
    dataloader: Any
    validate_dataloader: Any
    trajectory_pool: Any
    train_batch_pool: Any
    algorithm_processor: Any
    weight_sync_controller: Any
    validator: Any
    train_workers: list[Any]
    rollout_workers: list[Any]
    watch_interval_s: float = 0.02
    """Pause between the controller's polls while it waits for a validation to end."""
    progress_wait_s: float = 0.02
    """Longest wait of the controller's watch loop between two passes; a finished train
    step ends the wait at once (`WeightSyncController.wait_for_progress`)."""

    def named_modules(self) -> list[tuple[str, Any, bool]]:
        """(name, module, is_rollout_worker) for every module."""
        mods = [
            ("data_loader", self.dataloader, False),
            ("validate_dataloader", self.validate_dataloader, False),
            ("trajectory_pool", self.trajectory_pool, False),
            ("train_batch_pool", self.train_batch_pool, False),
            ("algorithm_processor", self.algorithm_processor, False),
            ("weight_sync_controller", self.weight_sync_controller, False),
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
        for worker in self.rollout_workers:
            execute(
                worker.set_module_references,
                pool,
                loader,
                wsc,
                self.validate_dataloader,
                self.validator,
            )
        execute(pool.set_module_references, loader, wsc)
        execute(
            self.algorithm_processor.set_module_references,
            pool,
            self.train_batch_pool,
            self.train_workers[0],
        )
        for worker in self.train_workers:
            execute(worker.set_module_references, self.train_batch_pool, wsc, loader)
        execute(wsc.set_module_references, loader, pool, self.validate_dataloader)
        execute(self.validator.set_module_references, self.validate_dataloader)

    def restarted_actors(self, settle: bool = False) -> dict[str, list[str]]:
        """Actor group -> module keys, for Ray actors that restarted since the last call
        (`settle`: first wait for actors being restarted to come back)."""
        return {}

    def flush_tracker(self) -> None:
        """Every tracker call queued in any process has arrived (Ray: the module actors'
        outboxes; local mode calls the tracker directly)."""

    def on_checkpoint_node(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` on the machine whose disk holds the checkpoints (the train
        worker's; Ray: a task on its node, as there may be no shared disk)."""
        return fn(*args)

    def describe_failure(self) -> str | None:
        """Ray: which node(s) of the run left the cluster and what to do; None here."""
        return None

    def loops(self) -> list[Any]:
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
        build = BUILDERS
        self.dataloader = build[NexRLRole.DATA_LOADER](cfg)
        self.validate_dataloader = build[NexRLRole.VALIDATE_DATALOADER](cfg)
        self.trajectory_pool = build[NexRLRole.TRAJECTORY_POOL](cfg)
        self.train_batch_pool = build[NexRLRole.TRAIN_BATCH_POOL](cfg)
        self.algorithm_processor = build[NexRLRole.ALGORITHM_PROCESSOR](cfg)
        self.weight_sync_controller = build[NexRLRole.WEIGHT_SYNC_CONTROLLER](cfg)
        self.validator = build[NexRLRole.VALIDATOR](cfg)
        self.train_workers = [
            build[NexRLRole.TRAIN_WORKER](cfg) for _ in range(cfg.train_worker.num_workers)
        ]
        self.rollout_workers = [
            build[NexRLRole.ROLLOUT_WORKER](cfg) for _ in range(cfg.rollout_worker.num_workers)
        ]
        self.name_and_track(ActivityTrackerProxy(self.activity_tracker))
        self.wire()

    def stop(self) -> None:
        from nexrl.inference.client import shutdown_local_engines

        super().stop()
        # the in-process engines belong to this run: a later run in the same
        # process must start from its own weights and version 0
        shutdown_local_engines()
