"""Validator: collects validation trajectories and turns them into `val/*` metrics.

Validation is complete when every task of the validation set came back, as a
trajectory or as a counted failure; the controller then logs the means.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Mapping
from typing import Any

from nexrl.execute import execute
from nexrl.module import NexRLModule
from nexrl.types import Trajectory


class Validator(NexRLModule):
    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self._config = config or {}
        self._lock = threading.Lock()
        self._trajectories: list[Trajectory] = []
        self._expected: int | None = None
        self._failed_at_start = 0
        self._validate_dataloader: Any = None

    def set_module_references(self, validate_dataloader: Any) -> None:
        self._validate_dataloader = validate_dataloader

    def begin(self, expected: int) -> None:
        """Start a validation round that expects `expected` trajectories."""
        with self._lock:
            self._trajectories = []
            self._expected = expected
        self._failed_at_start = self._failed()

    def put_trajectory(self, trajectory: Trajectory) -> str:
        with self._lock:
            self._trajectories.append(trajectory)
        return "success"

    def _failed(self) -> int:
        counters = self._activity_tracker.get_counters() if self._activity_tracker else {}
        return int(counters.get("tasks_failed/validate", 0))

    def is_complete(self) -> bool:
        with self._lock:
            received = len(self._trajectories)
        if self._expected is not None:
            return received + self._failed() - self._failed_at_start >= self._expected
        return bool(execute(self._validate_dataloader.is_finished)) and bool(
            self._activity_tracker.is_rollout_worker_quiescent()
        )

    def compute_metrics(self) -> dict[str, float]:
        with self._lock:
            trajs = list(self._trajectories)
        if not trajs:
            return {}
        metrics = {
            "val/reward": statistics.fmean(float(t["reward"]) for t in trajs),
            "val/response_length": statistics.fmean(len(t["response_ids"]) for t in trajs),
            "val/num_samples": float(len(trajs)),
        }
        score_keys = {k for t in trajs for k in (t.get("scores") or {})}
        for key in sorted(score_keys):
            vals = [float(t["scores"][key]) for t in trajs if key in (t.get("scores") or {})]
            metrics[f"val/{key}"] = statistics.fmean(vals)
        return metrics

    def compute_and_log_metrics(self) -> dict[str, float]:
        metrics = self.compute_metrics()
        if metrics and self._activity_tracker is not None:
            step = self._activity_tracker.get_training_step()
            self._activity_tracker.experiment_logger_post(
                backend="metrics", data=metrics, step=step
            )
        return metrics

    def clear(self) -> None:
        with self._lock:
            self._trajectories = []
            self._expected = None
