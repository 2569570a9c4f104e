"""TrainWorker: takes processed batches, trains, checkpoints, hands weights on.

Per step: the train side computes the old-policy logprobs of the batch (the
weights right before this update), runs the configured loss through the
`TrainServiceClient`, logs metrics, saves `global_step_N` every `save_freq`
steps, writes the new weights to the sync buffer and notifies the
WeightSyncController, which pushes them to the inference side.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import statistics
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from nexrl.config.schema import AlgorithmConfig, TrainWorkerConfig
from nexrl.execute import execute, is_remote
from nexrl.inference.weights import (
    SharedState,
    forget_in_memory,
    publish_in_memory,
    state_to_arrays,
)
from nexrl.module import BLOCKING_GET_WAIT_S, LoopModule, LoopThread
from nexrl.monitoring.ledger import checkpoint_ledger
from nexrl.monitoring.samples import with_staleness
from nexrl.protocols import (
    DataLoaderLike,
    TaskAdmissionLike,
    TrainBatchPoolLike,
    WeightArrays,
    WeightSyncLike,
)
from nexrl.training.checkpoint import atomic_directory
from nexrl.training.client import TrainServiceClient
from nexrl.types import DEFAULT_MODEL_TAG, Batch, LoaderState

if TYPE_CHECKING:
    import torch

    from nexrl.distributed.dp_train import RayDataParallelTrainClient
    from nexrl.monitoring.activity import ActivityTrackerProxy

logger = logging.getLogger(__name__)

STATE_FILE = "nexrl_state.json"


@dataclass
class PhaseTimer:
    """Seconds per phase of one train step, logged as `timing/<phase>_s`."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        return {f"timing/{name}_s": s for name, s in self.seconds.items()}


def staleness_metrics(
    step: int, min_versions: list[int], serving_version: int
) -> dict[str, float | dict[str, int]]:
    """Staleness of each sample trained at `step`: `step - min(token_versions)`."""
    stale = [step - v for v in min_versions]
    hist = Counter(stale)
    return {
        "staleness/min": min(stale),
        "staleness/mean": statistics.fmean(stale),
        "staleness/max": max(stale),
        "staleness/histogram": {str(k): hist[k] for k in sorted(hist)},
        "rollout/serving_version": serving_version,
    }


def logprob_gap(values: Mapping[str, torch.Tensor]) -> float:
    """Mean |old - behaviour| logprob on policy tokens: 0 when engine and trainer agree."""
    mask = values["loss_mask"]
    gap = (values["old_logprobs"] - values["behavior_logprobs"]).abs() * mask
    return float(gap.sum() / mask.sum().clamp(min=1))


def mini_batches(n: int, parts: int) -> list[list[int]]:
    """Split row indices 0..n-1 into `parts` contiguous slices (groups stay together)."""
    if parts < 1 or parts > n:
        raise ValueError(f"algorithm.num_mini_batches={parts} must be in [1, batch size {n}]")
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False)]


@dataclass(frozen=True)
class LossSpec:
    """The named loss and how each batch is cut into optimizer steps (from `algorithm.*`)."""

    loss_fn: str
    loss_kwargs: dict[str, object]
    num_mini_batches: int
    ppo_epochs: int

    @classmethod
    def from_config(cls, algorithm: AlgorithmConfig, sync_mode: str) -> LossSpec:
        """Async modes train on samples from older weights: token-level truncated IS
        (cap 2) by default, unless the user chose an off-policy correction (docs/async.md)."""
        kwargs = dict(algorithm.loss_kwargs or {})
        chosen = any(k in kwargs for k in ("tis_level", "decoupled"))
        if sync_mode != "sync" and not chosen:
            kwargs.update(tis_level="token", tis_cap=2.0)
        return cls(
            loss_fn=algorithm.loss_fn,
            loss_kwargs={"agg_mode": algorithm.loss_agg_mode, **kwargs},
            num_mini_batches=algorithm.num_mini_batches,
            ppo_epochs=algorithm.ppo_epochs,
        )


T = TypeVar("T")


def _wired(ref: T | None, what: str) -> T:
    """`ref`, set by the wiring (`set_module_references`, `set_activity_tracker`)."""
    if ref is None:
        raise RuntimeError(f"train worker: no {what}; the system wires it before the loop runs")
    return ref


class TrainWorker(LoopModule):
    def __init__(
        self,
        config: TrainWorkerConfig,
        train_client: TrainServiceClient | RayDataParallelTrainClient,
        loss: LossSpec,
        checkpoint_path: str,
        sync_weight_path: str,
        weights_in_memory: bool = False,
        share_weights: bool = False,
    ) -> None:
        super().__init__()
        self._config = config
        self._client = train_client
        self._loss_fn = loss.loss_fn
        self._loss_kwargs = dict(loss.loss_kwargs)
        self._num_mini_batches = loss.num_mini_batches
        self._ppo_epochs = loss.ppo_epochs
        self._total_train_steps = config.total_train_steps
        self._save_freq = config.save_freq
        self._remove_previous = config.remove_previous_ckpt
        self._checkpoint_path = Path(checkpoint_path)
        self._sync_weight_path = sync_weight_path
        self._weights_in_memory = weights_in_memory
        # the engine takes the trainer's tensors as its weights (a sync run, trainer and
        # engine in this process: no generation while the optimizer changes them)
        self._share_weights = share_weights and weights_in_memory
        self._model_tag = DEFAULT_MODEL_TAG
        self._step = 0
        self._last_step_end: float | None = None
        self._last_push: dict[str, float] = {}  # the previous step's push, logged with this one
        self._train_batch_pool: TrainBatchPoolLike | None = None
        self._weight_sync_controller: WeightSyncLike | None = None
        self._dataloader: DataLoaderLike | None = None
        self._admission: TaskAdmissionLike | None = None
        self._loop = LoopThread("train-worker", self._loop_once)

    def set_module_references(
        self,
        train_batch_pool: TrainBatchPoolLike,
        weight_sync_controller: WeightSyncLike,
        dataloader: DataLoaderLike | None = None,
        task_admission: TaskAdmissionLike | None = None,
    ) -> None:
        """`task_admission`: the task owner whose pending tasks each checkpoint saves."""
        self._train_batch_pool = train_batch_pool
        self._weight_sync_controller = weight_sync_controller
        self._dataloader = dataloader
        self._admission = task_admission

    def initialize_workers(self) -> None:
        self._client.initialize()

    def get_train_step(self) -> int:
        return self._step

    def set_train_step(self, step: int) -> None:
        self._step = step

    def _get_batch(self) -> Batch | None:
        pool = _wired(self._train_batch_pool, "train batch pool")
        return execute(pool.get_batch, self._model_tag, BLOCKING_GET_WAIT_S)

    def _loop_once(self) -> bool:
        if self._total_train_steps and self._step >= self._total_train_steps:
            return False
        batch = self._get_batch()
        if batch is None:
            return False
        with self._tracker().track(self._module_name, "train step"):
            self._step_batch(batch)
        return True

    def _step_batch(self, batch: Batch) -> None:
        """One step. Phases timed (`timing/<phase>_s`): ref (reference logprobs), old
        (old-policy logprobs; absent when the update's forward makes them), update,
        save, export (weights to the sync buffer) and push (the notify that, in sync
        mode, pushes them to the engine; logged with the next step's metrics)."""
        t0 = time.perf_counter()
        timer = PhaseTimer()
        if "ref_logprobs" not in batch.values:
            with timer.phase("ref"):
                ref = self._client.compute_ref_logprobs(batch)
            if ref is None:
                timer.seconds.pop("ref")  # no reference model
            else:
                batch.values["ref_logprobs"] = ref
        metrics = self._update(batch, timer)
        if "old_logprobs" in batch.values:  # absent when the update's forward made them
            metrics["behavior_old_logprob_absdiff"] = logprob_gap(batch.values)
        step = self._step + 1
        self._log_trained(step, batch)
        uids = batch.metadata.get("uids") or []
        # ledger: groups; counted before the step's checkpoint, which keeps the counts
        tracker = self._tracker()
        tracker.increment("tasks_trained", len(set(uids)))
        if self._save_freq and step % self._save_freq == 0 or step == self._total_train_steps:
            with timer.phase("save"):
                self.save_checkpoint(step)
        with timer.phase("export"):
            weights = self._export_for_push()
        wsc = _wired(self._weight_sync_controller, "weight-sync controller")
        serving = execute(wsc.get_rollout_model_version, self._model_tag)
        metrics_timing = {**timer.metrics(), **self._last_push}
        self._log(batch, metrics, t0, serving, step, metrics_timing)
        tracker.set_training_step(step)
        t_push = time.perf_counter()
        notify = wsc.train_worker_notify_weight_update
        extra = () if weights is None else (weights,)  # the tensors travel with the call
        execute(notify, self._module_name, self._model_tag, *extra)
        self._last_push = {"timing/push_s": time.perf_counter() - t_push}
        self._step = step  # visible to the controller only once the new weights are served

    def _update(self, batch: Batch, timer: PhaseTimer | None = None) -> dict[str, float]:
        """`ppo_epochs` passes over `num_mini_batches` slices: one optimizer step per slice.

        Old logprobs stay those of the weights before the first slice, so from the
        second slice on the policy ratio moves away from 1 and clipping applies. With a
        single optimizer step per batch the old policy is the current one in every sync
        mode (staleness only separates old from *behaviour* logprobs), so a client whose
        engine takes old logprobs from the update's own forward, detached
        (`fills_old_logprobs`), skips the extra no-grad pass: same loss, same gradient.
        """
        timer = timer or PhaseTimer()
        slices = mini_batches(len(batch), self._num_mini_batches)
        one_step = len(slices) == 1 and self._ppo_epochs == 1
        if one_step and getattr(self._client, "fills_old_logprobs", False):
            batch.values.pop("old_logprobs", None)
        else:
            with timer.phase("old"):
                batch.values["old_logprobs"] = self._client.compute_logprobs(batch)
        history: list[dict[str, float]] = []
        with timer.phase("update"):
            for _ in range(self._ppo_epochs):
                for rows in slices:
                    part = batch.select(rows) if len(slices) > 1 else batch
                    history.append(
                        self._client.train_batch(part, self._loss_fn, dict(self._loss_kwargs))
                    )
        return {k: statistics.fmean(h[k] for h in history) for k in history[0]}

    def _log(
        self,
        batch: Batch,
        metrics: dict[str, float],
        t0: float,
        serving: int,
        step: int,
        timing: dict[str, float],
    ) -> None:
        now = time.perf_counter()
        elapsed = now - (self._last_step_end if self._last_step_end is not None else t0)
        self._last_step_end = now
        tokens = float(batch.values["attention_mask"].sum())
        data = {
            **{f"train/{k}": v for k, v in metrics.items()},
            **batch.metadata.get("rollout_metrics", {}),
            **staleness_metrics(step - 1, batch.metadata["min_token_versions"], serving),
            "timing/step_s": elapsed,
            "timing/train_s": now - t0,
            # waiting for the batch: what the step took beyond training and the last push
            "timing/wait_s": max(0.0, elapsed - (now - t0) - timing.get("timing/push_s", 0.0)),
            **timing,
            "throughput/samples_per_s": len(batch) / elapsed,
            "throughput/tokens_per_s": tokens / elapsed,
        }
        tracker = self._tracker()
        tracker.experiment_logger_post(backend="metrics", data=data, step=step)
        if rows := batch.metadata.get("samples"):
            tracker.experiment_logger_post(
                backend="samples", rows=with_staleness(rows, step - 1), step=step
            )

    def compute_ref_logprobs(self, batch: Batch) -> torch.Tensor | None:
        """(B, T) reference-model logprobs, or None without a reference model."""
        return self._client.compute_ref_logprobs(batch)

    def stop(self) -> None:
        super().stop()
        if self._weights_in_memory and not self._engine_elsewhere():  # release the last copy
            forget_in_memory(self._sync_weight_path)
        if isinstance(self._client, TrainServiceClient):
            # its HTTP connection or child train process; a Ray data-parallel client's
            # rank actors are released with the run's Ray resources instead
            self._client.close()

    def _engine_elsewhere(self) -> bool:
        """The weight-sync controller (and so the engine) runs in another process (Ray)."""
        wsc = self._weight_sync_controller
        return wsc is not None and is_remote(wsc.train_worker_notify_weight_update)

    def _export_for_push(self) -> WeightArrays | None:
        """This step's export: the state dict when it travels with the push call (memory
        transport to another process), else None (exported where the engine reads it)."""
        if self._weights_in_memory and self._engine_elsewhere():
            return state_to_arrays(self._client.export_weights(None))
        self.export_sync_weights()
        return None

    def export_sync_weights(self) -> str:
        """Write the current weights to the weight-sync buffer folder or, with the memory
        transport (`weights_in_memory`), publish a copy under its path: in this process,
        or in the weight-sync controller's when that is another process."""
        if not self._weights_in_memory:
            return self._client.export_weights(self._sync_weight_path)
        if self._engine_elsewhere():
            state = self._client.export_weights(None)
            wsc = _wired(self._weight_sync_controller, "weight-sync controller")
            execute(wsc.publish_weights, state_to_arrays(state))
        else:
            # the trainer's own tensors, no copy: every push in this process copies them
            # into the engine before `train_worker_notify_weight_update` returns, so before
            # the next optimizer step changes them (one copy of the weights less)
            state = self._client.export_weights(None, False)
            publish_in_memory(
                self._sync_weight_path, SharedState(state) if self._share_weights else state
            )
        return self._sync_weight_path

    # -- checkpoints ---------------------------------------------------------------
    def save_checkpoint(self, step: int | None = None) -> str:
        """`global_step_N`: engine files and the run state, published as one atomic folder
        (a crash mid-save leaves no `global_step_N`; docs/reliability.md)."""
        step = self._step if step is None else step
        path = self._checkpoint_path / f"global_step_{step}"
        state: dict[str, object] = {"step": step, **self._task_state(step), **self._ledger()}
        with atomic_directory(path) as staging:
            self._client.save_checkpoint(str(staging))
            (staging / STATE_FILE).write_text(json.dumps(state))
        if self._remove_previous:  # but the one before: resume's fallback if this one fails
            older = sorted(
                (int(m.group(1)), p)
                for p in self._checkpoint_path.iterdir()
                if (m := re.match(r"global_step_(\d+)$", p.name)) and p != path and p.is_dir()
            )
            for _, old in older[:-1]:
                shutil.rmtree(old, ignore_errors=True)
        logger.info("saved checkpoint %s", path)
        return str(path)

    def _task_state(self, step: int) -> LoaderState:
        """The loader position and the tasks handed out but not trained after `step` steps,
        from the task owner in one snapshot (exactly once across crashes); without one,
        the loader position alone."""
        if self._admission is not None:
            state = execute(self._admission.checkpoint_state, self._model_tag, step)
            if state.get("dataloader") is None:
                state.pop("dataloader", None)
            return state
        if self._dataloader is not None and hasattr(self._dataloader, "state_dict"):
            return {"dataloader": execute(self._dataloader.state_dict)}
        return {}

    def _ledger(self) -> dict[str, dict[str, int]]:
        """The task ledger's settled counts, read after `_task_state`'s snapshot, so that a
        resumed run's end-of-run line covers the whole run (nexrl/monitoring/ledger.py)."""
        if self._activity_tracker is None:
            return {}
        return {"ledger": checkpoint_ledger(execute(self._activity_tracker.get_counters))}

    def _tracker(self) -> ActivityTrackerProxy:
        return _wired(self._activity_tracker, "activity tracker")

    def _log_trained(self, step: int, batch: Batch) -> None:
        """`train_worker.log_trained_uids`: one line per step, flushed before the step's
        checkpoint, so every checkpointed step has its line."""
        if not getattr(self._config, "log_trained_uids", False):
            return
        uids = sorted(set(batch.metadata.get("uids") or []), key=str)
        index = batch.metadata.get("batch_index")
        line = json.dumps({"step": step, "batch_index": index, "uids": uids})
        with (self._checkpoint_path.parent / "trained.jsonl").open("a", encoding="utf-8") as f:
            f.write(line + "\n")

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        self._client.load_checkpoint(path)
        state = json.loads((Path(path) / STATE_FILE).read_text())
        self._step = int(state["step"])
        return state
