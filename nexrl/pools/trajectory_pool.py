"""`TrajectoryPool`: collects trajectories per model tag and hands out batches of whole groups.

Each model tag gets a `TrajectoryPoolInstance` (its own store, lock and
weight-sync gate). Readiness rules (`check_batch_ready_function`):

- "batch_size": a batch is ready when `batch_size` trajectories of complete
  groups are waiting.
- "loaded_batch_finished": as above, plus the tail: when the data loader is
  finished and the rollout workers are quiescent (every loaded task has
  arrived), whatever complete groups remain form one smaller final batch.
  The tail is detected when polled (`get_batch`, `is_batch_ready`), since the
  worker that puts the last trajectory is itself still busy.

Weight-sync gate, in this order: the weight sync controller calls
`notify_weight_sync_starting(tag)`; from then on puts return "re-rollout"
(the worker gives the task back to the loader); after the new weights are live
it calls `unlock_for_weight_sync(tag)`. A group put with
`put_trajectory_group` is accepted or refused as a whole, so the gate can
never split a GRPO group.

Strict staleness (drop and resample): when a batch forms, the pool asks the
weight sync controller for the batch's index j and the bound k
(`get_staleness_gate`); a ready group whose oldest token version v has
j - v > k is dropped, its task (`trajectory["_nexrl_task"]`) goes back to the
front of the loader, the admission slot is released and `staleness/dropped`
counted; the batch keeps filling from the other groups. The formed batch is
reported with `notify_batch_formed` and carries `batch_index` and
`staleness_dropped` in its metadata.

Every time a put or poll makes another batch ready, the pool calls
`execute(weight_sync_controller.trajectory_pool_notify_batch_ready, tag)` once
for that batch, outside the pool's lock (the controller may call back).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from nexrl.distributed.execute import execute
from nexrl.module import NexRLModule
from nexrl.monitoring.errors import ErrorSeverity
from nexrl.pools.stores import make_store
from nexrl.types import DEFAULT_MODEL_TAG, Batch, ModelTag, Trajectory

logger = logging.getLogger(__name__)

CHECK_BATCH_READY_FUNCTIONS = ("batch_size", "loaded_batch_finished")
TASK_KEY = "_nexrl_task"  # the task a trajectory came from (re-queued if dropped as stale)


def min_version(traj: Trajectory) -> int | None:
    """Oldest weight version that sampled a token of `traj` (None: unversioned)."""
    versions = traj.get("token_versions") or []
    if versions:
        return int(min(versions))
    version = traj.get("model_version")
    return None if version is None else int(version)


def is_stale(group: list[Trajectory], gate: tuple[int, int] | None) -> bool:
    """Would `group` break the bound in batch `gate[0]` (bound `gate[1]`)?"""
    if gate is None:
        return False
    index, threshold = gate
    versions = [v for v in map(min_version, group) if v is not None]
    return bool(versions) and index - min(versions) > threshold


class TrajectoryPoolInstance:
    """Store, lock and weight-sync gate for one model tag."""

    def __init__(
        self,
        model_tag: ModelTag,
        batch_size: int,
        group_size: int,
        key_list: list[str],
        check_batch_ready_function: str = "batch_size",
    ) -> None:
        self.model_tag = model_tag
        self.batch_size = batch_size
        self.group_size = group_size if key_list else 1
        self._store = make_store(key_list, group_size)
        self._ready_rule = check_batch_ready_function
        self._lock = threading.RLock()
        self._locked = False
        self._notified = 0  # ready batches already announced to the weight sync controller
        self._dropped = 0  # stale groups dropped since the last batch was formed
        self._dataloader: Any = None
        self._weight_sync_controller: Any = None
        self._activity_tracker: Any = None

    def set_module_references(
        self, dataloader: Any, weight_sync_controller: Any, activity_tracker: Any = None
    ) -> None:
        self._dataloader = dataloader
        self._weight_sync_controller = weight_sync_controller
        self._activity_tracker = activity_tracker

    # ---- puts -------------------------------------------------------------
    def put_trajectory(self, trajectory: Trajectory) -> str:
        return self.put_trajectory_group([trajectory])

    def put_trajectory_group(self, trajectories: list[Trajectory]) -> str:
        """All or nothing: "success", "re-rollout" (gate closed) or "fail" (bad trajectory)."""
        with self._lock:
            if self._locked:
                return "re-rollout"
            try:
                self._store.add_group(trajectories)
            except KeyError as exc:
                reason = exc.args[0]
            else:
                reason = None
        if reason is not None:
            self.report_rejected(reason, len(trajectories))
            return "fail"
        self._announce_ready_batches(tail=False)
        return "success"

    def report_rejected(self, reason: str, n: int) -> None:
        message = f"trajectory pool [{self.model_tag}] rejected {n} trajectories: {reason}"
        logger.warning(message)
        if self._activity_tracker is not None:
            self._activity_tracker.report_error(
                "trajectory_pool", "put_trajectory", message, ErrorSeverity.WARNING
            )

    # ---- readiness ----------------------------------------------------------
    def _tail_reached(self) -> bool:
        """Loader finished and no rollout worker busy: everything loaded has arrived."""
        if self._ready_rule != "loaded_batch_finished" or self._dataloader is None:
            return False
        if not execute(self._dataloader.is_finished):
            return False
        tracker = self._activity_tracker
        return tracker is None or bool(tracker.is_rollout_worker_quiescent())

    def _ready_batches(self, tail: bool) -> int:
        ready = self._store.num_ready()
        full = ready // self.batch_size
        return full + 1 if tail and ready % self.batch_size else full

    def _announce_ready_batches(self, tail: bool) -> int:
        """Notify the weight sync controller of batches not yet announced; returns #ready."""
        with self._lock:
            ready = self._ready_batches(tail)
            new = max(0, ready - self._notified)
            self._notified = max(self._notified, ready)
        wsc = self._weight_sync_controller
        if wsc is not None:
            for _ in range(new):
                execute(wsc.trajectory_pool_notify_batch_ready, self.model_tag)
        return ready

    def is_batch_ready(self) -> bool:
        return self._announce_ready_batches(self._tail_reached()) > 0

    # ---- gets ---------------------------------------------------------------
    def get_batch(self, batch_size: int | None = None) -> Batch | None:
        """Exactly `batch_size` trajectories of whole groups (or the tail), else None.

        Groups that would be staler than the weight sync controller's bound in
        this batch are dropped first and their tasks re-queued (`_resample`).
        """
        size = self.batch_size if batch_size is None else int(batch_size)
        if size < 1 or size % self.group_size:
            raise ValueError(
                f"batch_size {size} must be a positive multiple of group_size {self.group_size}"
            )
        tail = self._tail_reached()
        self._announce_ready_batches(tail)
        gate = self._staleness_gate()
        with self._lock:
            stale = self._store.remove_ready_groups(lambda g: is_stale(g, gate)) if gate else []
            ready = self._store.num_ready()
            trajs: list[Trajectory] | None = None
            if ready >= size:
                trajs = self._store.take(size)
            elif tail and ready > 0:
                trajs = self._store.take(ready)
            self._dropped += len(stale)
            dropped = self._dropped
            if trajs is not None:
                self._dropped = 0
                self._notified = max(0, self._notified - 1)
            self._notified = min(self._notified, self._ready_batches(tail))
        self._resample(stale)
        if trajs is None:
            return None
        index = self._batch_formed(len(trajs) // self.group_size)
        return Batch.from_trajectories(
            trajs,
            model_tag=self.model_tag,
            group_size=self.group_size,
            batch_index=index,
            staleness_dropped=dropped,
        )

    # ---- staleness: drop and resample -------------------------------------------
    def _staleness_gate(self) -> tuple[int, int] | None:
        """(batch index, bound) from a controller that enforces staleness, else None."""
        gate = getattr(self._weight_sync_controller, "get_staleness_gate", None)
        return None if gate is None else tuple(execute(gate, self.model_tag))

    def _batch_formed(self, n_groups: int) -> int | None:
        formed = getattr(self._weight_sync_controller, "notify_batch_formed", None)
        return None if formed is None else execute(formed, self.model_tag, n_groups)

    def _resample(self, stale: list[list[Trajectory]]) -> None:
        """Give each dropped group's task back (served first) and count the drop."""
        for group in stale:
            task = group[0].get(TASK_KEY)
            if task is None or self._dataloader is None:
                raise RuntimeError(
                    f"trajectory pool [{self.model_tag}]: stale group {group[0].get('uid')!r} "
                    f"carries no {TASK_KEY!r} (or the pool has no data loader) to re-queue"
                )
            execute(self._dataloader.add_item_front, task)
            execute(self._weight_sync_controller.release_rollout, self.model_tag, "")
            if self._activity_tracker is not None:
                self._activity_tracker.increment("staleness/dropped")
        if stale:
            logger.info("trajectory pool [%s]: dropped %d stale groups", self.model_tag, len(stale))

    # ---- gate and state -----------------------------------------------------------
    def notify_weight_sync_starting(self) -> None:
        with self._lock:
            self._locked = True

    def unlock_for_weight_sync(self) -> None:
        with self._lock:
            self._locked = False

    def is_locked(self) -> bool:
        with self._lock:
            return self._locked

    def num_ready(self) -> int:
        with self._lock:
            return self._store.num_ready()

    def __len__(self) -> int:
        with self._lock:
            return len(self._store)

    def drain_incomplete(self) -> list[Trajectory]:
        with self._lock:
            return self._store.drain_incomplete()

    def clear(self) -> None:
        with self._lock:
            self._store.clear()
            self._notified = 0


class TrajectoryPool(NexRLModule):
    """Per-model-tag trajectory pools behind one module.

    Config keys (defaults): `batch_size` (required: trajectories per batch, e.g.
    16 prompts x 8 samples = 128), `group_size` (1), `key_list` (["uid"]; [] = no
    grouping), `check_batch_ready_function` ("batch_size" | "loaded_batch_finished").
    """

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        if config.get("batch_size", None) is None:
            raise ValueError("trajectory_pool.batch_size is required")
        self._batch_size = int(config["batch_size"])
        self._group_size = int(config.get("group_size", None) or 1)
        key_list = config.get("key_list", None)
        self._key_list = ["uid"] if key_list is None else [str(k) for k in key_list]
        rule = str(config.get("check_batch_ready_function", None) or "batch_size")
        if rule not in CHECK_BATCH_READY_FUNCTIONS:
            raise ValueError(
                f"trajectory_pool.check_batch_ready_function: unknown {rule!r}; "
                f"valid choices: {', '.join(CHECK_BATCH_READY_FUNCTIONS)}"
            )
        self._rule = rule
        if self._batch_size < 1 or (self._key_list and self._batch_size % self._group_size):
            raise ValueError(
                f"trajectory_pool.batch_size ({self._batch_size}) must be a positive multiple "
                f"of trajectory_pool.group_size ({self._group_size})"
            )
        self._instances: dict[ModelTag, TrajectoryPoolInstance] = {}
        self._lock = threading.Lock()
        self._arrivals = 0  # accepted puts so far; a waiting get_batch wakes on a change
        self._arrived = threading.Condition()
        self._lock_all = False  # a tag-less weight-sync lock also gates tags not seen yet
        self._dataloader: Any = None
        self._weight_sync_controller: Any = None

    # ---- wiring -------------------------------------------------------------
    def set_module_references(self, dataloader: Any, weight_sync_controller: Any) -> None:
        self._dataloader = dataloader
        self._weight_sync_controller = weight_sync_controller
        for inst in self._all():
            inst.set_module_references(dataloader, weight_sync_controller, self._activity_tracker)

    def set_activity_tracker(self, tracker: Any) -> None:
        super().set_activity_tracker(tracker)
        self.set_module_references(self._dataloader, self._weight_sync_controller)

    def _instance(self, model_tag: ModelTag) -> TrajectoryPoolInstance:
        with self._lock:
            inst = self._instances.get(model_tag)
            if inst is None:
                inst = TrajectoryPoolInstance(
                    model_tag, self._batch_size, self._group_size, self._key_list, self._rule
                )
                inst.set_module_references(
                    self._dataloader, self._weight_sync_controller, self._activity_tracker
                )
                if self._lock_all:
                    inst.notify_weight_sync_starting()
                self._instances[model_tag] = inst
            return inst

    def _all(self) -> list[TrajectoryPoolInstance]:
        with self._lock:
            return list(self._instances.values())

    def _selected(self, model_tag: ModelTag | None) -> list[TrajectoryPoolInstance]:
        if model_tag is None:
            return self._all()
        with self._lock:
            inst = self._instances.get(model_tag)
        return [] if inst is None else [inst]

    # ---- puts ---------------------------------------------------------------
    def put_trajectory(self, trajectory: Trajectory) -> str:
        """ "success", "fail" (rejected, reported) or "re-rollout" (weight sync in progress)."""
        tag = trajectory.get("model_tag") or DEFAULT_MODEL_TAG
        return self._arrival(self._instance(tag).put_trajectory(trajectory))

    def put_trajectory_group(self, trajectories: list[Trajectory]) -> str:
        """Put a whole group atomically (all accepted or none); same results as `put_trajectory`."""
        if not trajectories:
            return "success"
        tags = {t.get("model_tag") or DEFAULT_MODEL_TAG for t in trajectories}
        if len(tags) != 1:
            reason = f"one group has several model tags {sorted(tags)}"
            self._instance(sorted(tags)[0]).report_rejected(reason, len(trajectories))
            return "fail"
        return self._arrival(self._instance(tags.pop()).put_trajectory_group(trajectories))

    def _arrival(self, result: str) -> str:
        """Wake waiting `get_batch` calls after an accepted put; passes `result` through."""
        if result == "success":
            with self._arrived:
                self._arrivals += 1
                self._arrived.notify_all()
        return result

    # ---- gets ---------------------------------------------------------------
    def get_batch(
        self, batch_size: int | None = None, model_tag: ModelTag | None = None, wait_s: float = 0.0
    ) -> Batch | None:
        """`batch_size` trajectories of whole groups from `model_tag` (None: any tag).

        With `wait_s` > 0 and no batch yet, waits up to that long for another group to
        arrive and tries once more (the tail is found on that retry too).
        """
        with self._arrived:
            seen = self._arrivals
        batch = self._get_batch_now(batch_size, model_tag)
        if batch is not None or wait_s <= 0:
            return batch
        with self._arrived:
            self._arrived.wait_for(lambda: self._arrivals != seen, timeout=wait_s)
        return self._get_batch_now(batch_size, model_tag)

    def _get_batch_now(self, batch_size: int | None, model_tag: ModelTag | None) -> Batch | None:
        if model_tag is None:
            return self.get_batch_any(batch_size)
        insts = self._selected(model_tag)
        return insts[0].get_batch(batch_size) if insts else None

    def get_batch_any(self, batch_size: int | None = None) -> Batch | None:
        for inst in self._all():
            batch = inst.get_batch(batch_size)
            if batch is not None:
                return batch
        return None

    def is_batch_ready(self, model_tag: ModelTag | None = None) -> bool:
        """Whether a batch (or, under "loaded_batch_finished", the tail) can be taken."""
        return any(inst.is_batch_ready() for inst in self._selected(model_tag))

    # ---- state --------------------------------------------------------------
    def is_empty(self, model_tag: ModelTag | None = None) -> bool:
        """No trajectory held (ready or in an incomplete group) for the tag / all tags."""
        return all(len(inst) == 0 for inst in self._selected(model_tag))

    def num_ready(self, model_tag: ModelTag | None = None) -> int:
        return sum(inst.num_ready() for inst in self._selected(model_tag))

    def get_model_tags(self) -> list[ModelTag]:
        with self._lock:
            return list(self._instances)

    def drain_incomplete(self, model_tag: ModelTag | None = None) -> list[Trajectory]:
        """Remove and return trajectories of incomplete groups (for end-of-run accounting)."""
        return [t for inst in self._selected(model_tag) for t in inst.drain_incomplete()]

    def clear(self, model_tag: ModelTag | None = None) -> None:
        for inst in self._selected(model_tag):
            inst.clear()

    # ---- weight-sync gate ----------------------------------------------------
    def notify_weight_sync_starting(self, model_tag: ModelTag | None = None) -> None:
        """Close the gate: puts return "re-rollout" until `unlock_for_weight_sync`."""
        if model_tag is None:
            with self._lock:
                self._lock_all = True
            for inst in self._all():
                inst.notify_weight_sync_starting()
        else:
            self._instance(model_tag).notify_weight_sync_starting()

    def unlock_for_weight_sync(self, model_tag: ModelTag | None = None) -> None:
        if model_tag is None:
            with self._lock:
                self._lock_all = False
            for inst in self._all():
                inst.unlock_for_weight_sync()
        else:
            self._instance(model_tag).unlock_for_weight_sync()
