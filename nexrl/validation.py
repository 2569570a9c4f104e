"""Validator: collects validation trajectories and turns them into `val/*` metrics.

Validation is complete when every task of the validation set came back, as
`n_samples` trajectories or as a counted failure; the controller then logs:

- `val/reward`, `val/response_length`, `val/num_samples`, and the mean of each
  named reward component (`val/<name>`); rewards and pass@k are over the scored
  samples, and `val/unscored` counts those without a reward (a `simple` worker's);
- `val/time_s`: seconds from the start of the validation to its metrics;
- per source (the row column `validate.source_key`, e.g. `data_source`, when the
  rows have it): `val/<source>/reward`;
- with `validate.n_samples` = n > 1: `val/pass@k` for k = 1, 2, 4, ... up to n, the
  unbiased estimator 1 - C(n - c, k) / C(n, k) averaged over tasks, where c counts
  the task's samples with reward >= `validate.pass_threshold`.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import defaultdict

from nexrl.config.schema import ValidateConfig
from nexrl.execute import execute
from nexrl.module import NexRLModule
from nexrl.protocols import DataLoaderLike
from nexrl.types import StepResult, Trajectory


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn from n (c correct) is correct."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_up_to(n: int) -> list[int]:
    """1, 2, 4, ... and n itself."""
    ks = [2**i for i in range(n.bit_length()) if 2**i <= n]
    return sorted(set(ks) | {n})


class Validator(NexRLModule):
    def __init__(self, config: ValidateConfig | None = None) -> None:
        super().__init__()
        self._config = config or ValidateConfig()
        self._lock = threading.Lock()
        self._trajectories: list[Trajectory] = []
        self._expected: int | None = None
        self._failed_at_start = 0
        self._started: float | None = None
        self._validate_dataloader: DataLoaderLike | None = None

    def set_module_references(self, validate_dataloader: DataLoaderLike) -> None:
        self._validate_dataloader = validate_dataloader

    def begin(self, expected: int) -> None:
        """Start a validation round over `expected` tasks (`n_samples` trajectories each)."""
        with self._lock:
            self._trajectories = []
            self._expected = expected
            self._started = time.monotonic()
        self._failed_at_start = self._failed()

    def put_trajectory(self, trajectory: Trajectory) -> StepResult:
        """Keep one validation trajectory; always SUCCESS (every sample counts)."""
        with self._lock:
            self._trajectories.append(trajectory)
        return StepResult.SUCCESS

    def _failed(self) -> int:
        counters = self._activity_tracker.get_counters() if self._activity_tracker else {}
        return int(counters.get("tasks_failed/validate", 0))

    def is_complete(self) -> bool:
        with self._lock:
            received = len(self._trajectories)
        n = self._config.n_samples
        if self._expected is not None:
            failed = self._failed() - self._failed_at_start
            return received + failed * n >= self._expected * n
        loader, tracker = self._validate_dataloader, self._activity_tracker
        if loader is None or tracker is None:
            raise RuntimeError("validator: set_module_references and the tracker come first")
        return bool(execute(loader.is_finished)) and bool(tracker.is_rollout_worker_quiescent())

    def compute_metrics(self) -> dict[str, float]:
        with self._lock:
            trajs = list(self._trajectories)
        if not trajs:
            return {}
        metrics = {
            "val/response_length": statistics.fmean(len(t["response_ids"]) for t in trajs),
            "val/num_samples": float(len(trajs)),
        }
        scored = [t for t in trajs if t.get("reward") is not None]  # `simple` workers: None
        if len(scored) < len(trajs):
            metrics["val/unscored"] = float(len(trajs) - len(scored))
        trajs = scored
        if trajs:
            metrics["val/reward"] = statistics.fmean(float(t["reward"]) for t in trajs)
        score_keys = {k for t in trajs for k in (t.get("scores") or {})}
        for key in sorted(score_keys):
            vals = [float(t["scores"][key]) for t in trajs if key in (t.get("scores") or {})]
            metrics[f"val/{key}"] = statistics.fmean(vals)
        return {**metrics, **self._per_source(trajs), **self._pass_at_k(trajs)}

    def _per_source(self, trajs: list[Trajectory]) -> dict[str, float]:
        by_source: dict[str, list[float]] = defaultdict(list)
        for t in trajs:
            source = t.get("source")  # the row's `validate.source_key` column
            if source is not None:
                by_source[str(source)].append(float(t["reward"]))
        return {f"val/{s}/reward": statistics.fmean(r) for s, r in sorted(by_source.items())}

    def _pass_at_k(self, trajs: list[Trajectory]) -> dict[str, float]:
        n = self._config.n_samples
        if n <= 1:
            return {}
        correct: dict[object, list[bool]] = defaultdict(list)
        for t in trajs:
            correct[t["uid"]].append(float(t["reward"]) >= self._config.pass_threshold)
        tasks = [c for c in correct.values() if len(c) == n]
        if not tasks:
            return {}
        return {
            f"val/pass@{k}": statistics.fmean(pass_at_k(n, sum(c), k) for c in tasks)
            for k in ks_up_to(n)
        }

    def compute_and_log_metrics(self) -> dict[str, float]:
        metrics = self.compute_metrics()
        if metrics and self._started is not None:
            metrics["val/time_s"] = time.monotonic() - self._started
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
            self._started = None
