"""WeightSyncController: when new weights reach the inference side, and who may roll out.

Versions: the weights after `s` train steps have version `s` (one push per
step, so this is also the number of pushes; with `sync_every = m` the version
jumps by m). Batch j trains at step j, so a sample started on version v and
trained in batch j has staleness j - v, bounded by `staleness_threshold` k.

Modes (docs/weight_sync.md, docs/async.md):

- `sync`: the pool locks as soon as it holds a full batch: rollouts block,
  late samples are re-rolled, the batch trains, the new weights are pushed,
  and only then do rollouts resume. k is 0: every sample is on-policy.
- `batch-async`: rollouts of the next batches overlap training. After a train
  step (every `sync_every` steps) new rollouts are held, the running ones
  finish on the weights they started with, then the weights are pushed.
- `fully-async`: a push reaches running requests too: they are aborted
  (pause -> abort -> update -> resume); the rollout worker continues them on
  the new weights (`enable_partial_rollout`) or re-queues their task. With
  `inflight_weight_update` nothing is aborted: the engine swaps the weights
  between two decode steps and running requests go on with per-token versions.

In every mode a rollout group must be admitted before it starts
(`acquire_rollout`), which bounds staleness by construction
(`nexrl.rollout.sample_policy`); the trajectory pool re-checks each group when
its batch forms and drops the stale ones (`get_staleness_gate`,
`notify_batch_formed`). Usage order:

    worker -> acquire_rollout(tag) ... finish_generation(tag)
              [release_rollout(tag, reason) if the group never reaches the pool]
    pool   -> trajectory_pool_notify_batch_ready(tag)  (sync: lock, block rollouts)
           -> get_staleness_gate(tag); notify_batch_formed(tag, n_groups)
    train  -> train_worker_notify_weight_update(name, tag)  (push, maybe validate)
    ctrl   -> is_waiting_for_validation() -> start_validate / end_validate(tag)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal

from nexrl.distributed import execute
from nexrl.inference.protocol import WeightUpdateMeta
from nexrl.module import NexRLModule
from nexrl.rollout.sample_policy import AdmissionLedger, SamplePolicy
from nexrl.types import DEFAULT_MODEL_TAG, ModelTag

logger = logging.getLogger(__name__)

TAIL_KEY = "_nexrl_tail"
_POLL_S = 0.005


class WeightSyncController(NexRLModule):
    def __init__(self, config: Mapping[str, Any], llm_client: Any, sync_weight_path: str) -> None:
        super().__init__()
        self.policy = SamplePolicy.from_config(config)
        self._sync_mode = self.policy.sync_mode
        self._staleness_threshold = self.policy.staleness_threshold
        self._validate_freq = int(config.get("validate_freq", 0))
        self._llm_client = llm_client
        self._sync_weight_path = sync_weight_path
        # A condition on the state lock: every change notifies, so a rollout worker can wait
        # for admission (`acquire_rollout(wait_s=...)`) instead of polling with calls.
        self._lock = threading.Condition(threading.RLock())
        self._ledgers: dict[ModelTag, AdmissionLedger] = {}
        self._blocked: dict[ModelTag, bool] = {}
        self._pushing: dict[ModelTag, bool] = {}
        self._generating: dict[ModelTag, int] = {}
        self._trained: dict[ModelTag, int] = {}
        self._tail: dict[ModelTag, list[dict[str, Any]]] = {}
        self._syncs_since_validate = 0
        self._waiting_for_validation = False
        self._validating = False
        self._dataloader: Any = None
        self._trajectory_pool: Any = None

    def set_module_references(self, dataloader: Any, trajectory_pool: Any) -> None:
        self._dataloader = dataloader
        self._trajectory_pool = trajectory_pool

    def _ledger(self, tag: ModelTag) -> AdmissionLedger:
        if tag not in self._ledgers:
            self._ledgers[tag] = AdmissionLedger(self.policy)
        return self._ledgers[tag]

    def _count(self, name: str, n: int = 1) -> None:
        if self._activity_tracker is not None and n:
            self._activity_tracker.increment(name, n)

    # -- rollout side -----------------------------------------------------------
    def check_rollout_service_status(self, model_tag: ModelTag) -> Literal["continue", "block"]:
        """ "block" while requests must wait (sync: batch trains; fully-async: a push runs)."""
        with self._lock:
            if self._validating:
                return "continue"
            if self._blocked.get(model_tag, False):
                return "block"
            pushing = self._pushing.get(model_tag, False)
            return "block" if pushing and self._sync_mode == "fully-async" else "continue"

    def acquire_rollout(self, model_tag: ModelTag = DEFAULT_MODEL_TAG, wait_s: float = 0.0) -> bool:
        """Admit one rollout group (True) or not yet (False: ask again later).

        With `wait_s` > 0 it waits up to that long for admission, woken by every state
        change: in Ray mode a refused worker then makes a few calls a second, not hundreds.
        """
        deadline = time.monotonic() + wait_s
        with self._lock:
            while not self._try_acquire(model_tag):
                left = deadline - time.monotonic()
                if left <= 0 or self._validating:  # validation tasks need no admission
                    return False
                self._lock.wait(left)
            return True

    def _try_acquire(self, model_tag: ModelTag) -> bool:
        if self._pushing.get(model_tag, False) or self._blocked.get(model_tag, False):
            return False
        if not self._ledger(model_tag).acquire():
            return False
        self._generating[model_tag] = self._generating.get(model_tag, 0) + 1
        return True

    @contextmanager
    def _changing(self) -> Iterator[None]:
        """The state lock, for a change that may admit waiting rollouts: wakes them after."""
        with self._lock:
            yield
            self._lock.notify_all()

    def finish_generation(self, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> None:
        """The admitted group no longer talks to the engine (pairs with `acquire_rollout`)."""
        with self._changing():
            self._generating[model_tag] = max(0, self._generating.get(model_tag, 0) - 1)

    def release_rollout(self, model_tag: ModelTag = DEFAULT_MODEL_TAG, reason: str = "") -> None:
        """An admitted group will never land in a batch; `reason` is counted if given."""
        with self._changing():
            self._ledger(model_tag).release()
        if reason:
            self._count(f"rollout/released/{reason}")

    def get_rollout_model_version(self, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> int:
        with self._lock:
            return self._ledger(model_tag).version

    def set_rollout_model_version(self, model_tag: ModelTag, version: int) -> None:
        """Used on resume: the inference side already serves `version`."""
        with self._changing():
            self._ledger(model_tag).set_version(version)

    def set_train_step(self, model_tag: ModelTag, step: int) -> None:
        """Used on resume: `step` batches were trained before this run."""
        with self._changing():
            self._trained[model_tag] = step
            self._ledger(model_tag).formed = step

    def get_admission_state(self, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> dict[str, int]:
        """formed / version / outstanding / generating / tail candidates (tests, metrics)."""
        with self._lock:
            led = self._ledger(model_tag)
            return {
                "formed": led.formed,
                "version": led.version,
                "outstanding": led.outstanding,
                "generating": self._generating.get(model_tag, 0),
                "tail_candidates": len(self._tail.get(model_tag, [])),
            }

    # -- tail batch ---------------------------------------------------------------
    def add_tail_candidate(self, model_tag: ModelTag, task: dict[str, Any]) -> None:
        """Hold a too-often-aborted task; serve all candidates once enough wait."""
        with self._lock:
            pool = self._tail.setdefault(model_tag, [])
            pool.append(task)
            full = len(pool) >= self.policy.tail_trigger
        self._count("tail_batch/candidates")
        if full:
            self.flush_tail_candidates(model_tag)

    def flush_tail_candidates(self, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> int:
        """Serve every waiting candidate now, together, before new data; returns how many."""
        with self._lock:
            tasks = self._tail.pop(model_tag, [])
        for task in reversed(tasks):  # add_item_front: keep their order
            execute(self._dataloader.add_item_front, {**task, TAIL_KEY: True})
        if tasks:
            self._count("tail_batch/served", len(tasks))
            self._count("tail_batch/batches")
        return len(tasks)

    # -- pool side ---------------------------------------------------------------
    def trajectory_pool_notify_batch_ready(self, model_tag: ModelTag) -> None:
        if self._sync_mode != "sync":
            return
        with self._lock:
            self._blocked[model_tag] = True
        execute(self._trajectory_pool.notify_weight_sync_starting, model_tag)

    def get_staleness_gate(self, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> tuple[int, int]:
        """(index of the batch the pool forms next, staleness_threshold)."""
        with self._lock:
            return self._ledger(model_tag).formed, self._staleness_threshold

    def notify_batch_formed(self, model_tag: ModelTag, n_groups: int) -> int:
        """The pool cut the next batch from `n_groups` admitted groups; returns its index."""
        with self._changing():
            return self._ledger(model_tag).batch_formed(n_groups)

    # -- train side -------------------------------------------------------------
    def train_worker_notify_weight_update(self, worker_name: str, model_tag: ModelTag) -> None:
        """The trainer wrote new weights to the sync buffer: push them, maybe validate."""
        with self._lock:
            self._trained[model_tag] = self._trained.get(model_tag, 0) + 1
            due = self._trained[model_tag] % self.policy.sync_every == 0
        if self._sync_mode == "sync":
            self.sync_weight_to_rollout_service(model_tag)
        elif due:
            self._wait_validation_done()
            self._async_push(model_tag)
        else:
            return
        with self._lock:
            self._syncs_since_validate += 1
            due = self._validate_freq > 0 and self._syncs_since_validate >= self._validate_freq
            if due:
                self._syncs_since_validate = 0
                self._waiting_for_validation = True
                return
        self._unblock(model_tag)

    def _wait_validation_done(self) -> None:
        """Async modes: no push while a validation runs (it measures one version)."""
        while True:
            with self._lock:
                if not (self._validating or self._waiting_for_validation):
                    return
            time.sleep(_POLL_S)

    def _async_push(self, model_tag: ModelTag) -> None:
        with self._lock:
            self._pushing[model_tag] = True  # new rollouts wait (acquire_rollout -> False)
        try:
            if self._sync_mode == "batch-async":
                while True:  # running rollouts finish on the weights they started with
                    with self._lock:
                        if self._generating.get(model_tag, 0) == 0:
                            break
                    time.sleep(_POLL_S)
                self.sync_weight_to_rollout_service(model_tag)
            elif self.policy.inflight_weight_update:  # swapped between two decode steps
                self.sync_weight_to_rollout_service(model_tag)
            else:  # fully-async: the push reaches running requests
                self._llm_client.pause()
                self._llm_client.abort()
                try:
                    self.sync_weight_to_rollout_service(model_tag)
                finally:
                    self._llm_client.resume()
        finally:
            with self._changing():
                self._pushing[model_tag] = False

    def sync_weight_to_rollout_service(self, model_tag: ModelTag) -> None:
        with self._changing():
            led = self._ledger(model_tag)
            version = max(led.version + 1, self._trained.get(model_tag, 0))
            led.set_version(version)
        meta = WeightUpdateMeta(version=version, path=self._sync_weight_path)
        self._llm_client.update_weights(meta)
        logger.debug("pushed weights v%d for %s", version, model_tag)

    def _unblock(self, model_tag: ModelTag) -> None:
        with self._changing():
            self._blocked[model_tag] = False
        if self._sync_mode == "sync":
            execute(self._trajectory_pool.unlock_for_weight_sync, model_tag)

    # -- validation -------------------------------------------------------------
    def is_waiting_for_validation(self) -> bool:
        with self._lock:
            return self._waiting_for_validation

    def start_validate(self, model_tag: ModelTag) -> None:
        with self._changing():
            self._validating = True

    def end_validate(self, model_tag: ModelTag) -> None:
        with self._changing():
            self._validating = False
            was_waiting = self._waiting_for_validation
            self._waiting_for_validation = False
        if was_waiting:
            self._unblock(model_tag)
