"""WeightSyncController: the task owner of the rollout side and the one weight pusher.

Two jobs, each with one owner inside this module:

- tasks (`TaskAdmission`, nexrl/rollout/admission.py): rollout workers get
  their tasks here (`acquire_task`) and give them back with the step's result
  (`complete_task`); the trajectory pool settles each formed batch here with one
  call (`form_batch`). Admission bounds staleness by construction.
- weights: the train worker reports a finished step
  (`train_worker_notify_weight_update`) and this module alone pushes the new
  weights to the inference side and decides whether a validation runs first.

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
from typing import TYPE_CHECKING, Any, Literal, cast

from nexrl.config.schema import WeightConfig
from nexrl.inference.protocol import WeightUpdateMeta
from nexrl.inference.weights import publish_in_memory, state_from_arrays
from nexrl.module import NexRLModule
from nexrl.protocols import DataLoaderLike, TrackerLike
from nexrl.rollout.admission import BatchPlan, GroupInfo, TaskAdmission
from nexrl.rollout.sample_policy import SamplePolicy
from nexrl.types import DEFAULT_MODEL_TAG, ModelTag, StepResult, Task

if TYPE_CHECKING:
    from nexrl.monitoring.activity import ActivityTrackerProxy

logger = logging.getLogger(__name__)


class WeightSyncController(NexRLModule):
    def __init__(
        self,
        config: WeightConfig,
        llm_client: Any,
        sync_weight_path: str,
        groups_per_batch: int,
        max_task_retries: int,
        inflight_capable: bool = True,
        last_step: int = 0,
    ) -> None:
        """`last_step`: the run's final train step (0: none); once it is trained no
        training task is admitted, so the final validation has the engine to itself."""
        super().__init__()
        self._last_step = last_step
        self.policy = SamplePolicy.from_config(config, groups_per_batch, inflight_capable)
        self._sync_mode = self.policy.sync_mode
        self._validate_freq = config.validate_freq
        self._llm_client = llm_client
        self._sync_weight_path = sync_weight_path
        self.admission = TaskAdmission(self.policy, max_task_retries)
        self._lock = threading.Condition(threading.RLock())
        self._pushing: dict[ModelTag, bool] = {}
        self._trained: dict[ModelTag, int] = {}
        self._steps_done = 0  # train steps whose notify call has finished (any tag)
        self._syncs_since_validate = 0
        self._waiting_for_validation = False
        self._validating = False
        self._dataloader: DataLoaderLike | None = None
        self._validate_dataloader: DataLoaderLike | None = None

    def set_module_references(
        self,
        dataloader: DataLoaderLike,
        trajectory_pool: Any = None,
        validate_dataloader: DataLoaderLike | None = None,
    ) -> None:
        """`trajectory_pool` is accepted for the seed's signature and not kept: the pool
        calls this controller (`form_batch`), never the other way round."""
        self._dataloader, self._validate_dataloader = dataloader, validate_dataloader
        tracker = cast("TrackerLike | None", self._activity_tracker)
        self.admission.set_sources(dataloader, validate_dataloader, tracker)

    def set_activity_tracker(self, tracker: ActivityTrackerProxy) -> None:
        super().set_activity_tracker(tracker)
        self.admission.set_sources(
            self._dataloader, self._validate_dataloader, cast(TrackerLike, tracker)
        )

    # -- tasks (rollout workers, pool) ------------------------------------------------
    def acquire_task(
        self, model_tag: ModelTag = DEFAULT_MODEL_TAG, wait_s: float = 0.0
    ) -> Task | None:
        """The next task for a rollout worker: a validation task while validating, else a
        training task once admission allows one more group (waits up to `wait_s`)."""
        with self._lock:
            validating = self._validating
        return self.admission.acquire(model_tag, validating, wait_s)

    def complete_task(self, model_tag: ModelTag, task: Task, result: StepResult) -> None:
        """A worker finished `task` with `result`; it is routed by `TaskAdmission`."""
        self.admission.complete(model_tag, task, StepResult.of(result))

    def requeue_task(self, task: Task) -> None:
        """Give a task back to the front of its loader (seed `_put_rollout_task`)."""
        self.admission.requeue(task)

    def form_batch(self, model_tag: ModelTag, groups: list[GroupInfo], need: int) -> BatchPlan:
        """The pool's one call per batch (see `TaskAdmission.form_batch`)."""
        return self.admission.form_batch(model_tag, groups, need)

    def end_of_data(self, model_tag: ModelTag) -> bool:
        """No more groups of `model_tag` will reach the pool (`TaskAdmission.end_of_data`)."""
        return self.admission.end_of_data(model_tag)

    def pending_tasks(self) -> int:
        """Training tasks handed out and not yet trained, dropped, failed or given back (the
        task ledger: exact, where the activity tracker only sees work in brackets)."""
        return self.admission.pending_count()

    def drop_groups(self, model_tag: ModelTag, groups: list[GroupInfo], reason: str) -> int:
        """The pool drops groups that will never be trained; they are settled and counted."""
        return self.admission.drop_groups(model_tag, groups, reason)

    def get_admission_state(self, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> dict[str, int]:
        return self.admission.snapshot(model_tag)

    def check_rollout_service_status(self, model_tag: ModelTag) -> Literal["continue", "block"]:
        """ "block" while a fully-async push runs: new requests wait for the new weights."""
        with self._lock:
            pushing = self._pushing.get(model_tag, False)
            if self._validating or not pushing:
                return "continue"
            return "block" if self._sync_mode == "fully-async" else "continue"

    def get_rollout_model_version(self, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> int:
        return self.admission.version(model_tag)

    # -- weights (train worker, controller) ----------------------------------------------
    def train_worker_notify_weight_update(
        self, worker_name: str, model_tag: ModelTag, weights: dict[str, Any] | None = None
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
        self.admission.mark_trained(model_tag, trained)  # batch trained - 1 is done
        try:
            if self._last_step and trained >= self._last_step:
                self.admission.hold(model_tag, "finished", True)  # nothing more is trained
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
                self.admission.hold(model_tag, "validation", True)
            self.sync_weight_to_rollout_service(model_tag)
        else:
            self._wait_validation_done()
            self._async_push(model_tag)
        if validate:
            with self._lock:
                self._waiting_for_validation = True

    def publish_weights(self, arrays: dict[str, Any]) -> None:
        """Make these weights (`state_to_arrays`'s form) what the next push loads: the
        memory transport from a trainer in another process."""
        publish_in_memory(self._sync_weight_path, state_from_arrays(arrays))

    def resume_from(self, model_tag: ModelTag, step: int) -> None:
        """Resume: `step` batches were trained; push the loaded weights as version `step`."""
        with self._lock:
            self._trained[model_tag] = step
        self.admission.set_formed(model_tag, step)
        self.sync_weight_to_rollout_service(model_tag)

    def reset_tasks(self) -> None:
        """A Ray rewind: forget every task and batch (the checkpoint's pending tasks come
        back through `restore_tasks`), and any pending validation or push state."""
        self.admission.reset()
        with self._lock:
            self._pushing.clear()
            self._trained.clear()
            self._syncs_since_validate = 0
            self._waiting_for_validation = False
            self._validating = False
            self._lock.notify_all()

    def checkpoint_tasks(self, model_tag: ModelTag, trained: int) -> dict[str, Any]:
        """For the checkpoint of step `trained`: the loader state and the pending tasks,
        taken together (`TaskAdmission.checkpoint_state`)."""
        return self.admission.checkpoint_state(model_tag, trained)

    def restore_tasks(self, pending: list[dict[str, Any]]) -> int:
        """Resume: a checkpoint's pending tasks go to the front of the loader."""
        return self.admission.restore(pending)

    def _wait_validation_done(self) -> None:
        """Async modes: no push while a validation runs (it measures one version)."""
        with self._lock:
            self._lock.wait_for(lambda: not (self._validating or self._waiting_for_validation))

    def _async_push(self, model_tag: ModelTag) -> None:
        with self._lock:
            self._pushing[model_tag] = True
        self.admission.hold(model_tag, "push", True)
        try:
            if self._sync_mode == "batch-async":  # running rollouts finish on their weights
                self.admission.wait_idle(model_tag)
                self.sync_weight_to_rollout_service(model_tag)
            elif self.policy.inflight_weight_update:  # swapped between two decode steps
                self.sync_weight_to_rollout_service(model_tag)
            else:  # fully-async: the push reaches the requests still running after the grace
                self.admission.wait_idle(model_tag, timeout=self.policy.abort_grace_s)
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
            self.admission.hold(model_tag, "push", False)

    def sync_weight_to_rollout_service(self, model_tag: ModelTag) -> None:
        """Push the sync buffer's weights to the inference side as the next version."""
        with self._lock:
            version = max(self.admission.version(model_tag) + 1, self._trained.get(model_tag, 0))
        self._llm_client.update_weights(
            WeightUpdateMeta(version=version, path=self._sync_weight_path)
        )
        self.admission.set_version(model_tag, version)
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
        with self._lock:
            self._validating = True
            self._lock.notify_all()

    def end_validate(self, model_tag: ModelTag) -> None:
        with self._lock:
            self._validating = False
            self._waiting_for_validation = False
            self._lock.notify_all()
        self.admission.hold(model_tag, "validation", False)

    # -- seed 000 name (a thin alias) --------------------------------------------------------
    def trajectory_pool_notify_batch_ready(self, model_tag: ModelTag) -> dict[str, int]:
        """Seed 000's "a batch is ready" call. In nexrl the pool reports a batch through
        `form_batch`, which does the coordination (staleness check, sync-mode hold), so this
        name changes nothing; it returns the admission state of `model_tag` (counts of tasks
        in flight, held, dropped) for callers that check it."""
        return self.get_admission_state(model_tag)
