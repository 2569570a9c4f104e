"""WeightSyncController: when new weights reach the inference side.

Versions count weight pushes (0 = the initial weights). In `sync` mode the
pool locks as soon as it holds a full batch: rollouts block, late samples are
re-rolled, the batch trains, the new weights are pushed, and only then do
rollouts resume - every trained sample is on-policy. Usage order:

    pool  -> trajectory_pool_notify_batch_ready(tag)     (lock, block rollouts)
    train -> train_worker_notify_weight_update(name, tag) (push weights, v += 1)
    ctrl  -> is_waiting_for_validation() -> start_validate / end_validate(tag)
             (validation runs on the new weights before rollouts resume)

The asynchronous modes (`batch-async`, `fully-async`) are accepted by the
config schema and documented in docs/weight_sync.md; this controller
implements their blocking rule through `staleness_threshold`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any, Literal

from nexrl.distributed import execute
from nexrl.inference.protocol import WeightUpdateMeta
from nexrl.module import NexRLModule
from nexrl.types import DEFAULT_MODEL_TAG, ModelTag

logger = logging.getLogger(__name__)


class WeightSyncController(NexRLModule):
    def __init__(self, config: Mapping[str, Any], llm_client: Any, sync_weight_path: str) -> None:
        super().__init__()
        self._sync_mode = str(config.get("sync_mode", "sync"))
        self._staleness_threshold = int(config.get("staleness_threshold", 0))
        self._validate_freq = int(config.get("validate_freq", 0))
        self._llm_client = llm_client
        self._sync_weight_path = sync_weight_path
        self._lock = threading.RLock()
        self._versions: dict[ModelTag, int] = {}
        self._blocked: dict[ModelTag, bool] = {}
        self._syncs_since_validate = 0
        self._waiting_for_validation = False
        self._validating = False
        self._dataloader: Any = None
        self._trajectory_pool: Any = None

    def set_module_references(self, dataloader: Any, trajectory_pool: Any) -> None:
        self._dataloader = dataloader
        self._trajectory_pool = trajectory_pool

    # -- rollout side -----------------------------------------------------------
    def check_rollout_service_status(self, model_tag: ModelTag) -> Literal["continue", "block"]:
        with self._lock:
            if self._validating:
                return "continue"
            return "block" if self._blocked.get(model_tag, False) else "continue"

    def get_rollout_model_version(self, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> int:
        with self._lock:
            return self._versions.get(model_tag, 0)

    def set_rollout_model_version(self, model_tag: ModelTag, version: int) -> None:
        """Used on resume: the inference side already serves `version`."""
        with self._lock:
            self._versions[model_tag] = version

    # -- pool side ---------------------------------------------------------------
    def trajectory_pool_notify_batch_ready(self, model_tag: ModelTag) -> None:
        if self._sync_mode != "sync":
            return
        with self._lock:
            self._blocked[model_tag] = True
        execute(self._trajectory_pool.notify_weight_sync_starting, model_tag)

    # -- train side -------------------------------------------------------------
    def train_worker_notify_weight_update(self, worker_name: str, model_tag: ModelTag) -> None:
        """The trainer wrote new weights to the sync buffer: push them, maybe validate."""
        self.sync_weight_to_rollout_service(model_tag)
        with self._lock:
            self._syncs_since_validate += 1
            due = self._validate_freq > 0 and self._syncs_since_validate >= self._validate_freq
            if due:
                self._syncs_since_validate = 0
                self._waiting_for_validation = True
                return
        self._unblock(model_tag)

    def sync_weight_to_rollout_service(self, model_tag: ModelTag) -> None:
        with self._lock:
            version = self._versions.get(model_tag, 0) + 1
            self._versions[model_tag] = version
        meta = WeightUpdateMeta(version=version, path=self._sync_weight_path)
        self._llm_client.update_weights(meta)
        logger.debug("pushed weights v%d for %s", version, model_tag)

    def _unblock(self, model_tag: ModelTag) -> None:
        with self._lock:
            self._blocked[model_tag] = False
        if self._sync_mode == "sync":
            execute(self._trajectory_pool.unlock_for_weight_sync, model_tag)

    # -- validation -------------------------------------------------------------
    def is_waiting_for_validation(self) -> bool:
        with self._lock:
            return self._waiting_for_validation

    def start_validate(self, model_tag: ModelTag) -> None:
        with self._lock:
            self._validating = True

    def end_validate(self, model_tag: ModelTag) -> None:
        with self._lock:
            self._validating = False
            was_waiting = self._waiting_for_validation
            self._waiting_for_validation = False
        if was_waiting:
            self._unblock(model_tag)
