"""`TrajectoryPool`: collects trajectories per model tag and hands out batches of whole groups.

Each model tag gets a `TrajectoryPoolInstance` (its own store and lock).
Readiness rules (`check_batch_ready_function`):

- "batch_size": a batch is ready when `batch_size` trajectories of complete
  groups are waiting. At the end of the data the complete groups that cannot
  fill a batch are dropped and counted (`groups_dropped/end_of_data`), like a
  loader with `drop_last=True`.
- "loaded_batch_finished": as above, but at the end of the data whatever
  complete groups remain form one smaller final batch (`drop_last=False`).

End of the data: the loader is finished, no rollout worker is busy, and the
task owner has every handed-out task in a pool or a formed batch
(`end_of_data`), so no further group can arrive.

Forming a batch is one call to the task owner (`TaskAdmission`):
`form_batch(tag, groups, need)` gets the ready groups' task ids and oldest
token versions and answers which groups form the batch (its index) and which
are staler than the bound (their tasks are re-queued by the task owner; the
pool only discards their trajectories). The pool never touches a loader's queue
and needs no lock against weight syncs: admission keeps rollouts within budget.

A group put with `put_trajectory_group` is accepted or refused as a whole, and
is complete by definition: a rollout worker puts each task's whole group (every
episode's trajectories) in one call, so a group is formed by episodes, not by
counting trajectories. Puts answer `StepResult.SUCCESS` or `StepResult.FAIL`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from nexrl.config.schema import TrajectoryPoolConfig
from nexrl.execute import execute
from nexrl.module import NexRLModule
from nexrl.monitoring.errors import ErrorSeverity
from nexrl.pools.stores import make_store
from nexrl.protocols import DataLoaderLike, TaskAdmissionLike, TrackerLike
from nexrl.rollout.admission import BatchPlan, GroupInfo
from nexrl.types import (
    DEFAULT_MODEL_TAG,
    Batch,
    ModelTag,
    StepResult,
    Trajectory,
    check_trajectory,
)

if TYPE_CHECKING:
    from nexrl.monitoring.activity import ActivityTrackerProxy

logger = logging.getLogger(__name__)

CHECK_BATCH_READY_FUNCTIONS = ("batch_size", "loaded_batch_finished")
END_OF_DATA = "end_of_data"  # the reason counted for the remainder dropped at the end


def min_version(traj: Trajectory) -> int | None:
    """Oldest weight version that sampled a policy token of `traj` (None: unversioned);
    tokens inserted by tools or the environment carry -1 and are not counted."""
    versions = [v for v in traj.get("token_versions") or [] if v >= 0]
    if versions:
        return int(min(versions))
    version = traj.get("model_version")
    return None if version is None else int(version)


def group_info(group: list[Trajectory]) -> GroupInfo:
    versions = [v for v in map(min_version, group) if v is not None]
    return GroupInfo(group[0].get("task_id"), min(versions) if versions else None)


class PoolRefs:
    """The pool's references, shared by its instances (set after construction)."""

    def __init__(self) -> None:
        self.dataloader: DataLoaderLike | None = None
        self.admission: TaskAdmissionLike | None = None
        self.tracker: TrackerLike | None = None


class TrajectoryPoolInstance:
    """Store and lock for one model tag."""

    def __init__(
        self,
        model_tag: ModelTag,
        config: TrajectoryPoolConfig,
        refs: PoolRefs,
    ) -> None:
        self.model_tag = model_tag
        self.batch_size = config.batch_size
        self.group_size = config.group_size if config.key_list else 1
        self._store = make_store(list(config.key_list), config.group_size)
        self._ready_rule = config.check_batch_ready_function
        self._lock = threading.RLock()
        self._forming = threading.Lock()  # one batch formation at a time
        self._refs = refs

    # ---- puts -------------------------------------------------------------
    def put_trajectory_group(
        self, trajectories: list[Trajectory], whole: bool = True
    ) -> StepResult:
        """All or nothing: SUCCESS, or FAIL (a malformed trajectory; reported). `whole`: the
        trajectories are one complete group; else each joins its group (`put_trajectory`)."""
        try:
            for traj in trajectories:
                check_trajectory(traj)
            with self._lock:
                if whole:
                    self._store.add_group(trajectories)
                else:
                    for traj in trajectories:
                        self._store.add(traj)
        except (KeyError, ValueError) as exc:
            self.report_rejected(str(exc.args[0]), len(trajectories))
            return StepResult.FAIL
        return StepResult.SUCCESS

    def report_rejected(self, reason: str, n: int) -> None:
        message = f"trajectory pool [{self.model_tag}] rejected {n} trajectories: {reason}"
        logger.warning(message)
        if self._refs.tracker is not None:
            self._refs.tracker.report_error(
                "trajectory_pool", "put_trajectory", message, ErrorSeverity.WARNING
            )

    # ---- readiness ----------------------------------------------------------
    def _end_of_data(self) -> bool:
        """Nothing more will arrive: the loader is finished, no rollout worker is busy and
        the task owner has every handed-out task in a pool or a formed batch."""
        refs = self._refs
        if refs.dataloader is None or not execute(refs.dataloader.is_finished):
            return False
        if refs.tracker is not None and not refs.tracker.is_rollout_worker_quiescent():
            return False
        return refs.admission is None or execute(refs.admission.end_of_data, self.model_tag)

    def is_batch_ready(self) -> bool:
        with self._lock:
            ready = self._store.num_ready()
        if ready >= self.batch_size:
            return True
        tail = self._ready_rule == "loaded_batch_finished"
        return tail and ready > 0 and self._end_of_data()

    # ---- gets ---------------------------------------------------------------
    def get_batch(self, batch_size: int | None = None) -> Batch | None:
        """Exactly `batch_size` trajectories of whole groups (or the tail), else None.

        At the end of the data the complete groups that do not fill a batch form a final
        smaller batch under "loaded_batch_finished", and are dropped (settled with the task
        owner, counted as `groups_dropped/end_of_data`) under "batch_size"."""
        size = self.batch_size if batch_size is None else int(batch_size)
        if size < 1 or size % self.group_size:
            raise ValueError(
                f"batch_size {size} must be a positive multiple of group_size {self.group_size}"
            )
        with self._forming:
            groups, tail = self._ready_or_tail(size)
            ready = sum(len(g) for g in groups)
            if ready < size and not tail:
                return None
            if tail and self._ready_rule == "batch_size":
                self._drop_remainder(groups, size)
                return None
            need = 0 if tail else size // self.group_size
            plan = self._plan([group_info(g) for g in groups], need)
            with self._lock:
                picked = self._store.pop_groups(plan.take + plan.stale)
        if plan.stale:
            logger.info(
                "trajectory pool [%s]: dropped %d stale groups", self.model_tag, len(plan.stale)
            )
        by_pos = dict(zip(sorted(plan.take + plan.stale), picked, strict=True))
        trajs = [t for pos in plan.take for t in by_pos[pos]]
        if not trajs:
            return None
        return Batch.from_trajectories(
            trajs,
            model_tag=self.model_tag,
            group_size=self.group_size,
            batch_index=plan.index,
            staleness_dropped=len(plan.stale),
        )

    def _ready_or_tail(self, size: int) -> tuple[list[list[Trajectory]], bool]:
        """The ready groups, and whether they are the tail (fewer than `size` trajectories
        and the end of the data). The end is asked after a short snapshot, then the groups
        are read again: the last group may arrive between the two reads, and once the end
        is reached nothing else can."""
        with self._lock:
            groups = self._store.ready_groups()
        ready = sum(len(g) for g in groups)
        if ready >= size or ready == 0 or not self._end_of_data():
            return groups, False
        with self._lock:
            groups = self._store.ready_groups()
        return groups, sum(len(g) for g in groups) < size

    def _drop_remainder(self, groups: list[list[Trajectory]], size: int) -> None:
        """End of the data under "batch_size": the groups that cannot fill a batch leave."""
        admission, tracker = self._refs.admission, self._refs.tracker
        if admission is not None:
            execute(
                admission.drop_groups, self.model_tag, [group_info(g) for g in groups], END_OF_DATA
            )
        elif tracker is not None:
            tracker.increment(f"groups_dropped/{END_OF_DATA}", len(groups))
        with self._lock:
            self._store.pop_groups(list(range(len(groups))))
        logger.warning(
            "trajectory pool [%s]: end of the data: dropped %d groups (%d trajectories) that "
            "do not fill a batch of %d; trajectory_pool.check_batch_ready_function="
            "loaded_batch_finished trains them as a smaller final batch",
            self.model_tag,
            len(groups),
            sum(len(g) for g in groups),
            size,
        )

    def _plan(self, groups: list[GroupInfo], need: int) -> BatchPlan:
        admission = self._refs.admission
        if admission is not None:
            return execute(admission.form_batch, self.model_tag, groups, need)
        take = list(range(len(groups)))[: need or None]  # no task owner: plain FIFO
        return BatchPlan(index=None, take=take if len(take) >= max(need, 1) else [])

    # ---- state -----------------------------------------------------------------
    def num_ready(self) -> int:
        with self._lock:
            return self._store.num_ready()

    def __len__(self) -> int:
        with self._lock:
            return len(self._store)

    def drain_incomplete(self) -> list[Trajectory]:
        with self._lock:
            return self._store.drain_incomplete()

    def describe_wait(self, shown: int = 3) -> str:
        """What a batch of this tag waits for, in one line (stall reports)."""
        with self._lock:
            ready, groups = self._store.num_ready(), self._store.incomplete_groups()
        line = (
            f"pool [{self.model_tag}]: {ready} of {self.batch_size} trajectories ready for a batch"
        )
        if groups:
            parts = [
                f"{'/'.join(map(str, path))}: {n} of {self.group_size}"
                for path, n in groups[:shown]
            ]
            more = f" and {len(groups) - shown} more" if len(groups) > shown else ""
            line += f"; {len(groups)} incomplete group(s) ({', '.join(parts)}{more})"
        return line

    def clear(self) -> None:
        with self._lock:
            self._store.clear()

    # ---- seed 000 names (thin aliases; the pool's own path is above) ----------------
    def set_module_references(
        self,
        dataloader: DataLoaderLike | None,
        task_admission: TaskAdmissionLike | None,
        activity_tracker: TrackerLike | None,
    ) -> None:
        """Seed 000's wiring of one instance (the seed passes the weight-sync controller
        where nexrl passes the task owner). The references are the pool's (every instance
        shares them): `TrajectoryPool.set_module_references` sets the same ones."""
        self._refs.dataloader = dataloader
        self._refs.admission = task_admission
        self._refs.tracker = activity_tracker

    def put_trajectory(self, trajectory: Trajectory) -> StepResult:
        """Seed 000's single put: SUCCESS, FAIL, or REROLL ("re-rollout") while a weight
        sync holds this instance (`notify_weight_sync_starting`)."""
        if getattr(self, "_seed_sync_hold", False):
            return StepResult.REROLL
        return self.put_trajectory_group([trajectory])

    def notify_weight_sync_starting(self) -> None:
        """Seed 000: refuse `put_trajectory` ("re-rollout") until `unlock_for_weight_sync`.
        nexrl's own workers are held earlier, before generating (the weight-sync
        controller's admission), so their group puts are never refused here."""
        self._seed_sync_hold = True

    def unlock_for_weight_sync(self) -> None:
        """Seed 000: accept `put_trajectory` again."""
        self._seed_sync_hold = False


class TrajectoryPool(NexRLModule):
    """Per-model-tag trajectory pools behind one module (config: `trajectory_pool.*`)."""

    def __init__(self, config: TrajectoryPoolConfig) -> None:
        super().__init__()
        if config.check_batch_ready_function not in CHECK_BATCH_READY_FUNCTIONS:
            raise ValueError(
                "trajectory_pool.check_batch_ready_function: unknown "
                f"{config.check_batch_ready_function!r}; valid choices: "
                f"{', '.join(CHECK_BATCH_READY_FUNCTIONS)}"
            )
        group = config.group_size if config.key_list else 1
        if config.batch_size < 1 or config.group_size < 1 or config.batch_size % group:
            raise ValueError(
                f"trajectory_pool.batch_size ({config.batch_size}) must be a positive multiple "
                f"of trajectory_pool.group_size ({config.group_size})"
            )
        self._config = config
        self._refs = PoolRefs()
        self._instances: dict[ModelTag, TrajectoryPoolInstance] = {}
        self._lock = threading.Lock()
        self._arrivals = 0  # accepted puts so far; a waiting get_batch wakes on a change
        self._arrived = threading.Condition()

    # ---- wiring -------------------------------------------------------------
    def set_module_references(
        self, dataloader: DataLoaderLike | None, task_admission: TaskAdmissionLike | None
    ) -> None:
        """`task_admission` settles each batch (`form_batch`) and says when the data ends."""
        self._refs.dataloader = dataloader
        self._refs.admission = task_admission

    def set_activity_tracker(self, tracker: ActivityTrackerProxy) -> None:
        super().set_activity_tracker(tracker)
        self._refs.tracker = tracker

    def _instance(self, model_tag: ModelTag) -> TrajectoryPoolInstance:
        with self._lock:
            if model_tag not in self._instances:
                self._instances[model_tag] = TrajectoryPoolInstance(
                    model_tag, self._config, self._refs
                )
            return self._instances[model_tag]

    def _selected(self, model_tag: ModelTag | None) -> list[TrajectoryPoolInstance]:
        with self._lock:
            if model_tag is None:
                return list(self._instances.values())
            inst = self._instances.get(model_tag)
        return [] if inst is None else [inst]

    # ---- puts ---------------------------------------------------------------
    def put_trajectory(self, trajectory: Trajectory) -> StepResult:
        """One trajectory that joins its group (complete at `group_size`): SUCCESS, or FAIL
        (rejected and reported)."""
        return self._put([trajectory], whole=False)

    def put_trajectory_group(self, trajectories: list[Trajectory]) -> StepResult:
        """Put a whole group atomically (all accepted or none); the put is the group, however
        many trajectories its episodes made (see the module docstring)."""
        return self._put(trajectories, whole=True)

    def _put(self, trajectories: list[Trajectory], whole: bool) -> StepResult:
        if not trajectories:
            return StepResult.SUCCESS
        tags = {t.get("model_tag") or DEFAULT_MODEL_TAG for t in trajectories}
        if len(tags) != 1:
            reason = f"one group has several model tags {sorted(tags)}"
            self._instance(sorted(tags)[0]).report_rejected(reason, len(trajectories))
            return StepResult.FAIL
        result = self._instance(tags.pop()).put_trajectory_group(trajectories, whole)
        if result is StepResult.SUCCESS:  # wake waiting `get_batch` calls
            with self._arrived:
                self._arrivals += 1
                self._arrived.notify_all()
        return result

    # ---- gets ---------------------------------------------------------------
    def get_batch(
        self, batch_size: int | None = None, model_tag: ModelTag | None = None, wait_s: float = 0.0
    ) -> Batch | None:
        """`batch_size` trajectories of whole groups from `model_tag` (None: any tag).

        With `wait_s` > 0 and no batch yet, tries again at each group's arrival until a
        batch (or the tail) forms or `wait_s` has passed: one waiting call per batch, not
        one per group (in Ray mode each return is a round trip from another actor).
        """
        deadline = time.monotonic() + wait_s
        while True:
            with self._arrived:
                seen = self._arrivals
            batch = self._get_batch_now(batch_size, model_tag)
            left = deadline - time.monotonic()
            if batch is not None or left <= 0:
                return batch
            with self._arrived:
                self._arrived.wait_for(lambda: self._arrivals != seen, timeout=left)  # noqa: B023

    def _get_batch_now(self, batch_size: int | None, model_tag: ModelTag | None) -> Batch | None:
        for inst in self._selected(model_tag):
            batch = inst.get_batch(batch_size)
            if batch is not None:
                return batch
        return None

    def get_batch_any(self, batch_size: int | None = None) -> Batch | None:
        return self._get_batch_now(batch_size, None)

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

    def describe_wait(self, model_tag: ModelTag | None = None) -> str:
        """One line per tag: trajectories ready against the batch size, incomplete groups
        with how many trajectories each holds against `group_size` (stall reports)."""
        lines = [inst.describe_wait() for inst in self._selected(model_tag)]
        return "; ".join(lines) if lines else "pool: no trajectory has arrived yet"
