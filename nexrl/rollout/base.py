"""Rollout workers: take a task, produce trajectories, hand them on.

`BaseRolloutWorker` owns the loop and the bookkeeping; subclasses implement
`step(task)` only. The loop's contract with `step`:

    "success"     the trajectories were accepted by the pool (or validator)
    "re-rollout"  the pool refused them (a weight sync began): the task goes
                  back to the front of its loader and is generated again
    "fail" / None the task could not be turned into trajectories; it is put
                  back up to `max_task_retries` times, then counted as failed
    "aborted"     a weight push aborted the generation (fully-async without
                  partial rollout): the task goes back to the FRONT of its
                  loader (aborted samples are served before new data)
    "deferred"    the task was aborted too often and now waits in the weight
                  sync controller's tail-batch candidate pool
    "dropped"     the group was dropped on purpose (DAPO dynamic sampling)

Admission (docs/async.md): before a training task is taken, the worker asks
the weight sync controller for a slot (`acquire_rollout`); a group that will
never reach the pool gives it back (`release_rollout`) with the reason. Each
task taken fresh from the loader counts once in `tasks_in/train`; the ledger
tasks_in = tasks_trained + dropped + failed + still queued holds at any time.

An exception inside `step` (an engine error, a reward function that raises)
is reported through the activity tracker's ErrorReporter and treated as
"fail", so no task is ever silently lost: every task is trained, still
queued, or counted in the `tasks_failed` counter.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from nexrl.distributed import execute
from nexrl.module import BLOCKING_GET_WAIT_S, LoopModule, LoopThread
from nexrl.types import DEFAULT_MODEL_TAG, Trajectory

logger = logging.getLogger(__name__)

VALIDATE_FLAG = "_nexrl_validate"
RETRIES_KEY = "_nexrl_retries"
SEEN_KEY = "_nexrl_seen"  # set once a task has been counted in tasks_in
TASK_KEY = "_nexrl_task"  # the task a training trajectory came from (see pools)
_RELEASE_REASONS = {
    "re-rollout": "re-rollout",
    "aborted": "abort",
    "deferred": "tail_candidate",
    "dropped": "dynamic_sampling",
}


class BaseRolloutWorker(LoopModule):
    """Pulls tasks from a loader, calls `step`, routes the outcome."""

    def __init__(self, config: Mapping[str, Any], llm_client: Any) -> None:
        super().__init__()
        self._config = config
        self._llm_client = llm_client
        self._max_task_retries = int(config.get("max_task_retries", 2))
        self._is_running_validate = False
        self._task_is_validate = False  # mode of the task being processed now
        self._current_task: dict[str, Any] = {}
        self._trajectory_pool: Any = None
        self._dataloader: Any = None
        self._weight_sync_controller: Any = None
        self._validate_dataloader: Any = None
        self._validator: Any = None
        self._loop = LoopThread(f"rollout-{id(self):x}", self._loop_once)

    def set_module_references(
        self,
        trajectory_pool: Any,
        dataloader: Any,
        weight_sync_controller: Any,
        validate_dataloader: Any = None,
        validator: Any = None,
    ) -> None:
        self._trajectory_pool = trajectory_pool
        self._dataloader = dataloader
        self._weight_sync_controller = weight_sync_controller
        self._validate_dataloader = validate_dataloader
        self._validator = validator
        if weight_sync_controller is not None:
            self._llm_client.set_weight_sync_controller(weight_sync_controller)

    # -- lifecycle ---------------------------------------------------------
    def run(self) -> None:
        if self._trajectory_pool is None or self._activity_tracker is None:
            raise RuntimeError(f"{self._module_name}: set module references and tracker first")
        super().run()

    def begin_validate(self) -> None:
        self._is_running_validate = True

    def end_validate(self) -> None:
        self._is_running_validate = False

    # -- the loop ------------------------------------------------------------
    def _loop_once(self) -> bool:
        validate = self._is_running_validate
        tag = self._model_tag()
        if not validate and not self._acquire(tag):
            return False
        task = self._get_rollout_task(validate)
        if task is None:
            if not validate:
                self._release(tag, "")
                self._flush_tail(tag)
            return False
        self._task_is_validate = validate
        self._current_task = task
        with self._activity_tracker.track(self._module_name, "rollout", auto_report_errors=False):
            try:
                result = self.step(task)
            except Exception as exc:  # reported, then the task is retried or counted
                self._activity_tracker.report_exception(self._module_name, "rollout step", exc)
                result = "fail"
            finally:
                if not validate:
                    self._finish_generation(tag)
            if not validate and result != "success":
                self._release(tag, _RELEASE_REASONS.get(str(result), "fail"))
            self._route(task, result)
        return True

    def _route(self, task: dict[str, Any], result: str | None) -> None:
        if result in ("success", "deferred", "dropped"):
            return
        if result in ("re-rollout", "aborted"):
            self._put_rollout_task(task)
            return
        retries = int(task.get(RETRIES_KEY, 0))
        if retries < self._max_task_retries:
            self._put_rollout_task({**task, RETRIES_KEY: retries + 1})
        else:
            kind = "validate" if task.get(VALIDATE_FLAG) else "train"
            self._activity_tracker.increment(f"tasks_failed/{kind}")
            logger.warning(
                "%s: task %s failed %d times; counted as failed",
                self._module_name,
                task.get("uid"),
                retries + 1,
            )

    # -- admission (weight sync controller) -------------------------------------------
    def _model_tag(self) -> str:
        return getattr(self._llm_client, "model_tag", DEFAULT_MODEL_TAG)

    def _acquire(self, tag: str) -> bool:
        wsc = self._weight_sync_controller
        return wsc is None or bool(execute(wsc.acquire_rollout, tag, BLOCKING_GET_WAIT_S))

    def _release(self, tag: str, reason: str) -> None:
        if self._weight_sync_controller is not None:
            execute(self._weight_sync_controller.release_rollout, tag, reason)

    def _finish_generation(self, tag: str) -> None:
        if self._weight_sync_controller is not None:
            execute(self._weight_sync_controller.finish_generation, tag)

    def _flush_tail(self, tag: str) -> None:
        """The loader ran dry: tail-batch candidates are served now instead of waiting."""
        if self._weight_sync_controller is not None:
            execute(self._weight_sync_controller.flush_tail_candidates, tag)

    # -- data flow -------------------------------------------------------------
    def step(self, task: dict[str, Any]) -> str | None:
        """Turn one task into trajectories and hand them on (see module docstring)."""
        raise NotImplementedError

    @property
    def is_validating_task(self) -> bool:
        """True while `step` runs on a validation task."""
        return self._task_is_validate

    def _source(self, validate: bool) -> Any:
        return self._validate_dataloader if validate else self._dataloader

    def _get_rollout_task(self, validate: bool | None = None) -> dict[str, Any] | None:
        validate = self._is_running_validate if validate is None else validate
        loader = self._source(validate)
        if loader is None:
            return None
        task = execute(loader.get_next_item)
        if task is None:
            return None
        if not validate and not task.get(SEEN_KEY):
            self._activity_tracker.increment("tasks_in/train")
            task = {**task, SEEN_KEY: True}
        return {**task, VALIDATE_FLAG: validate}

    def _put_rollout_task(self, task: dict[str, Any]) -> bool:
        loader = self._source(bool(task.get(VALIDATE_FLAG)))
        clean = {k: v for k, v in task.items() if k != VALIDATE_FLAG}
        execute(loader.add_item_front, clean)
        return True

    def _put_trajectory(self, trajectory: Trajectory) -> str:
        return self._put_trajectory_group([trajectory])

    def _put_trajectory_group(self, trajectories: list[Trajectory]) -> str:
        """Hand a whole group on atomically; validation tasks go to the validator."""
        if self._task_is_validate:
            for t in trajectories:
                execute(self._validator.put_trajectory, t)
            return "success"
        task = {k: v for k, v in self._current_task.items() if k != VALIDATE_FLAG}
        group = [{**t, TASK_KEY: task} for t in trajectories]
        return execute(self._trajectory_pool.put_trajectory_group, group)
