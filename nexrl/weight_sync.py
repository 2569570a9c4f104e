"""WeightSyncController: the one weight pusher, and the owner of the served version.

The train worker reports a finished step (`train_worker_notify_weight_update`);
this module alone pushes the new weights to the inference side, numbers them,
and decides whether a validation runs first. Tasks are not its job: rollout
workers and the trajectory pool talk to `TaskAdmission`
(nexrl/rollout/admission.py) directly; this module only tells admission what it
must know to bound staleness (`set_version` after a push, `hold` while a push or
a validation runs, `mark_trained` after a step, `set_validating`).

Versions: the weights after `s` train steps have version `s` (with
`sync_every = m` the version jumps by m). Batch j trains at step j, so a sample
started on version v and trained in batch j has staleness j - v, bounded by
`staleness_threshold` k.

Modes (docs/weight_sync.md, docs/async.md):

- `sync`: k = 0 and one batch worth of groups may be admitted at a time, so
  once a batch forms nothing generates until its weights are pushed.
- `batch-async`: rollouts of the next batches overlap training; a push holds new
  admissions, waits until running rollouts finish, then pushes.
- `fully-async`: a push reaches running requests: they are aborted
  (pause -> abort -> update -> resume) and continued or re-queued by the worker;
  with `inflight_weight_update` the engine swaps weights between decode steps
  and nothing is aborted.
"""

from __future__ import annotations

import logging
import threading
from typing import Literal

from nexrl.config.schema import WeightConfig
from nexrl.execute import execute
from nexrl.inference.protocol import WeightUpdateMeta
from nexrl.inference.weights import publish_in_memory, state_from_arrays
from nexrl.module import NexRLModule
from nexrl.protocols import InferenceControlLike, TaskAdmissionLike, WeightArrays
from nexrl.rollout.sample_policy import SamplePolicy
from nexrl.types import DEFAULT_MODEL_TAG, ModelTag

logger = logging.getLogger(__name__)


class WeightSyncController(NexRLModule):
    """Pushes weights after train steps and numbers them (see the module docstring)."""

    def __init__(
        self,
        config: WeightConfig,
        llm_client: InferenceControlLike,
        sync_weight_path: str,
        inflight_capable: bool = True,
        last_step: int = 0,
    ) -> None:
        """`last_step`: the run's final train step (0: none); once it is trained no
        training task is admitted, so the final validation has the engine to itself."""
        super().__init__()
        self._last_step = last_step
        self.policy = SamplePolicy.from_config(config, None, inflight_capable)
        self._sync_mode = self.policy.sync_mode
        self._validate_freq = config.validate_freq
        self._llm_client = llm_client
        self._sync_weight_path = sync_weight_path
        self._admission: TaskAdmissionLike | None = None
        self._lock = threading.Condition(threading.RLock())
        self._pushing: dict[ModelTag, bool] = {}
        self._trained: dict[ModelTag, int] = {}
        self._versions: dict[ModelTag, int] = {}
        self._steps_done = 0  # train steps whose notify call has finished (any tag)
        self._syncs_since_validate = 0
        self._waiting_for_validation = False
        self._validating = False

    def set_module_references(self, task_admission: TaskAdmissionLike) -> None:
        """The task owner this controller holds and releases around pushes."""
        self._admission = task_admission

    def _tasks(self) -> TaskAdmissionLike:
        if self._admission is None:
            raise RuntimeError(f"{self._module_name}: set_module_references(task_admission) first")
        return self._admission

    # -- serving side (rollout workers, their client) -------------------------------------
    def check_rollout_service_status(self, model_tag: ModelTag) -> Literal["continue", "block"]:
        """ "block" while a fully-async push runs: new requests wait for the new weights."""
        with self._lock:
            pushing = self._pushing.get(model_tag, False)
            if self._validating or not pushing:
                return "continue"
            return "block" if self._sync_mode == "fully-async" else "continue"

    def get_rollout_model_version(self, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> int:
        """The version the inference side serves for `model_tag` (0: the initial weights)."""
        with self._lock:
            return self._versions.get(model_tag, 0)

    def trajectory_pool_notify_batch_ready(self, model_tag: ModelTag) -> dict[str, int]:
        """Seed 000's "a batch is ready" call, kept as an alias for code written against it:
        the pool reports batches to the task owner (`TaskAdmission.set_formed`), which
        does the coordination, so this changes nothing and returns that owner's counts
        for `model_tag` (tasks in flight, held, dropped)."""
        return execute(self._tasks().snapshot, model_tag)

    # -- weights (train worker, controller) ----------------------------------------------
    def train_worker_notify_weight_update(
        self, worker_name: str, model_tag: ModelTag, weights: WeightArrays | None = None
    ) -> None:
        """The trainer exported new weights: push them, maybe validate. `weights`: the
        weights themselves (`publish_weights`), when they travel with this call
        (`weight.transport` memory, the trainer in another process)."""
        if weights is not None:
            self.publish_weights(weights)
        with self._lock:
            self._trained[model_tag] = self._trained.get(model_tag, 0) + 1
            trained = self._trained[model_tag]
            due = trained % self.policy.sync_every == 0
        execute(self._tasks().mark_trained, model_tag, trained)  # batch trained - 1 is done
        try:
            if self._last_step and trained >= self._last_step:  # nothing more is trained
                execute(self._tasks().hold, model_tag, "finished", True)
            if due:
                self._push_after_step(model_tag)
        finally:
            with self._lock:
                self._steps_done += 1
                self._lock.notify_all()  # wakes `wait_for_progress`

    def _push_after_step(self, model_tag: ModelTag) -> None:
        with self._lock:
            self._syncs_since_validate += 1
            validate = 0 < self._validate_freq <= self._syncs_since_validate
            if validate:
                self._syncs_since_validate = 0
        if self._sync_mode == "sync":
            # held before the push admits the next batch: the validation has the engine
            # to itself, and the next batch is generated by the validated weights
            if validate:
                execute(self._tasks().hold, model_tag, "validation", True)
            self.sync_weight_to_rollout_service(model_tag)
        else:
            self._wait_validation_done()
            self._async_push(model_tag)
        if validate:
            with self._lock:
                self._waiting_for_validation = True

    def publish_weights(self, arrays: WeightArrays) -> None:
        """Make these weights (`state_to_arrays`'s form) what the next push loads: the
        memory transport from a trainer in another process."""
        publish_in_memory(self._sync_weight_path, state_from_arrays(arrays))

    def resume_from(self, model_tag: ModelTag, step: int) -> None:
        """Resume: `step` batches were trained; push the loaded weights as version `step`."""
        with self._lock:
            self._trained[model_tag] = step
        execute(self._tasks().set_formed, model_tag, step)
        self.sync_weight_to_rollout_service(model_tag)

    def reset(self) -> None:
        """A Ray rewind: forget the push, version and validation state (the task owner is
        reset on its own, `TaskAdmission.reset`; the checkpoint's weights are pushed again
        by `resume_from`)."""
        with self._lock:
            self._pushing.clear()
            self._trained.clear()
            self._versions.clear()
            self._syncs_since_validate = 0
            self._waiting_for_validation = False
            self._validating = False
            self._lock.notify_all()

    def _wait_validation_done(self) -> None:
        """Async modes: no push while a validation runs (it measures one version)."""
        with self._lock:
            self._lock.wait_for(lambda: not (self._validating or self._waiting_for_validation))

    def _async_push(self, model_tag: ModelTag) -> None:
        admission = self._tasks()
        with self._lock:
            self._pushing[model_tag] = True
        execute(admission.hold, model_tag, "push", True)
        try:
            if self._sync_mode == "batch-async":  # running rollouts finish on their weights
                execute(admission.wait_idle, model_tag)
                self.sync_weight_to_rollout_service(model_tag)
            elif self.policy.inflight_weight_update:  # swapped between two decode steps
                self.sync_weight_to_rollout_service(model_tag)
            else:  # fully-async: the push reaches the requests still running after the grace
                execute(admission.wait_idle, model_tag, self.policy.abort_grace_s)
                self._llm_client.pause()
                self._llm_client.abort()
                try:
                    self.sync_weight_to_rollout_service(model_tag)
                finally:
                    self._llm_client.resume()
        finally:
            with self._lock:
                self._pushing[model_tag] = False
                self._lock.notify_all()
            execute(admission.hold, model_tag, "push", False)

    def sync_weight_to_rollout_service(self, model_tag: ModelTag) -> None:
        """Push the sync buffer's weights to the inference side as the next version."""
        with self._lock:
            current = self._versions.get(model_tag, 0)
            version = max(current + 1, self._trained.get(model_tag, 0))
        self._llm_client.update_weights(
            WeightUpdateMeta(version=version, path=self._sync_weight_path)
        )
        with self._lock:
            self._versions[model_tag] = version
        execute(self._tasks().set_version, model_tag, version)
        logger.debug("pushed weights v%d for %s", version, model_tag)

    def wait_for_progress(self, seen: int, timeout: float) -> int:
        """The controller's watch loop: return once more than `seen` train steps have been
        notified (their push done, a due validation flagged), or after `timeout` s; the
        count. One blocking call a step instead of polls through the step."""
        with self._lock:
            self._lock.wait_for(lambda: self._steps_done != seen, timeout)
            return self._steps_done

    # -- validation (controller) ------------------------------------------------------------
    def is_waiting_for_validation(self) -> bool:
        with self._lock:
            return self._waiting_for_validation

    def start_validate(self, model_tag: ModelTag) -> None:
        """Workers get validation tasks (from admission) until `end_validate`."""
        with self._lock:
            self._validating = True
            self._lock.notify_all()
        execute(self._tasks().set_validating, True)

    def end_validate(self, model_tag: ModelTag) -> None:
        execute(self._tasks().set_validating, False)
        with self._lock:
            self._validating = False
            self._waiting_for_validation = False
            self._lock.notify_all()
        execute(self._tasks().hold, model_tag, "validation", False)
