"""Seed 004's single-controller names: `RolloutController`, `TrainController`.

"They have the same API as InferenceEngine and TrainEngine": here they are that
API on an engine in this process. `LocalScheduler` (the default) is the only
scheduler: nexrl schedules engines across machines with Ray (`launch_mode:
ray`, docs/ray.md), so a Slurm or Kubernetes scheduler object is refused by
name instead of being ignored.
"""

from __future__ import annotations

from typing import Any


class LocalScheduler:
    """Runs every engine in this process."""


def _check_scheduler(scheduler: Any) -> None:
    if scheduler is not None and not isinstance(scheduler, LocalScheduler):
        raise ValueError(
            f"scheduler {type(scheduler).__name__} is not supported: nexrl places engines on a "
            "cluster with Ray (launch_mode=ray); use LocalScheduler() or None here"
        )


class _Controller:
    def __init__(self, engine: Any, config: Any = None, scheduler: Any = None) -> None:
        _check_scheduler(scheduler)
        self.engine, self.config, self.scheduler = engine, config, scheduler or LocalScheduler()

    def __getattr__(self, name: str) -> Any:
        if name == "engine":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.engine, name)


class RolloutController(_Controller):
    """An `InferenceEngine` driven from the training script (same methods)."""


class TrainController(_Controller):
    """A `TrainEngine` (or `Actor` / `Critic`) driven from the training script."""
