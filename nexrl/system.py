"""The set of running modules, built and wired for one launch mode.

`LocalSystem` builds every module in this process. A Ray system exposes the
same attributes with actor wrappers in place of objects; the controller cannot
tell the difference because it only talks to modules through `execute`.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from nexrl.builders import BUILDERS
from nexrl.distributed import execute
from nexrl.monitoring import ActivityTracker, ActivityTrackerProxy
from nexrl.types import NexRLRole


def build_system(cfg: DictConfig) -> Any:
    """The modules of a run, built for `cfg.launch_mode`."""
    if cfg.launch_mode == "ray":
        from nexrl.distributed.ray_system import RaySystem

        return RaySystem(cfg)
    return LocalSystem(cfg)


class LocalSystem:
    """Every module in this process; loops run in threads."""

    def __init__(self, cfg: DictConfig) -> None:
        self.activity_tracker = ActivityTracker(cfg)
        proxy = ActivityTrackerProxy(self.activity_tracker)
        tracker = self.activity_tracker
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
        self._name_and_track(proxy, tracker)
        self._wire()

    def _named(self) -> list[tuple[str, Any, bool]]:
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

    def _name_and_track(self, proxy: Any, tracker: Any) -> None:
        for name, module, is_rollout in self._named():
            execute(module.set_module_name, name)
            execute(module.set_activity_tracker, proxy)
            tracker.register_module(name, module, is_rollout_worker=is_rollout)

    def _wire(self) -> None:
        for worker in self.rollout_workers:
            execute(
                worker.set_module_references,
                self.trajectory_pool,
                self.dataloader,
                self.weight_sync_controller,
                self.validate_dataloader,
                self.validator,
            )
        execute(
            self.trajectory_pool.set_module_references, self.dataloader, self.weight_sync_controller
        )
        execute(
            self.algorithm_processor.set_module_references,
            self.trajectory_pool,
            self.train_batch_pool,
        )
        for worker in self.train_workers:
            execute(
                worker.set_module_references,
                self.train_batch_pool,
                self.weight_sync_controller,
                self.dataloader,
            )
        execute(
            self.weight_sync_controller.set_module_references, self.dataloader, self.trajectory_pool
        )
        execute(self.validator.set_module_references, self.validate_dataloader)

    def _loops(self) -> list[Any]:
        return [*self.train_workers, self.algorithm_processor, *self.rollout_workers]

    def start(self) -> None:
        for module in self._loops():
            execute(module.run)

    def stop(self) -> None:
        from nexrl.inference.client import shutdown_local_engines

        for module in reversed(self._loops()):
            execute(module.stop)
        # the in-process engines belong to this run: a later run in the same
        # process must start from its own weights and version 0
        shutdown_local_engines()
