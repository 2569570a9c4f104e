"""`TaskAdmission`: the one owner of a task's life on the rollout side.

It hands tasks out (a training task only when the staleness budget admits one
more group), takes them back with the step's result and routes them, and
settles groups when the trajectory pool forms a batch. No other module puts a
task back into a loader, so "where did my task go" has one answer. It is a
module of its own (role `task_admission`): rollout workers and the trajectory
pool hold a reference to it and call it directly, and the weight-sync
controller tells it about versions and holds:

    acquire(tag, wait_s)            -> Task | None   admission, then the loader
    complete(tag, task, result)                      route by StepResult
    form_batch(tag, groups, need)   -> BatchPlan     staleness check, batch index
    set_version(tag, v) / hold(tag, why, on)         from the weight-sync controller
    set_validating(on)                               from the weight-sync controller

Routing of `complete` (docs/rollout.md):

    SUCCESS   group in the pool; the task is settled when its batch forms
    REROLL    back to the front of its loader
    ABORTED   back to the front (aborted samples are served before new data)
    FAIL      back to the front up to `max_task_retries` times, then counted failed
    DEFERRED  held as a tail-batch candidate; all are served together once
              `tail_trigger` wait, or when the loader runs dry
    DROPPED   counted (DAPO dynamic sampling)

End of the data (`end_of_data`): the loader is finished and every handed-out
task is in the pool or a formed batch. The pool then forms a final smaller
batch (`loaded_batch_finished`) or drops the remainder (`drop_groups`,
counted as `groups_dropped/end_of_data`).

The ledger `tasks_in/train = tasks_trained + dropped + failed + queued` holds at
any time because every hand-out and every route is counted here.

Exactly once across crashes (docs/reliability.md): every training task handed
out is kept in `_live` until it is trained (its batch index is below the
trained-step count, `mark_trained`), dropped, finally failed, or given back to
its loader. `checkpoint_state(tag, trained)` takes the loader's state and the
live tasks not yet trained in one critical section (`_io`, which every
loader hand-out and give-back holds too), so a task is either in the loader
state or in the pending list, never both and never neither; on resume the
pending tasks go back to the front of the loader (`restore`).

Thread safety: one lock guards the state; loader calls happen outside it (in
Ray mode they are calls to another actor). Two conditions share that lock:
workers waiting for admission sleep on `_cond`, which only the changes that can
admit a group notify (capacity released, a batch formed, a new version, a hold
lifted), and `wait_idle` sleeps on `_idle`, which every finished group notifies.
A group that reaches the pool changes nothing admission reads, so the workers
already waiting are not woken by each other's groups.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

from nexrl.data.base import item_from_state, item_to_state
from nexrl.execute import execute
from nexrl.module import NexRLModule
from nexrl.protocols import DataLoaderLike
from nexrl.rollout.sample_policy import AdmissionLedger, SamplePolicy
from nexrl.types import JSONDict, ModelTag, PendingTasks, StepResult, Task

logger = logging.getLogger(__name__)

_RELEASE_REASON = {
    StepResult.REROLL: "re-rollout",
    StepResult.ABORTED: "abort",
    StepResult.DEFERRED: "tail_candidate",
    StepResult.DROPPED: "dynamic_sampling",
    StepResult.FAIL: "fail",
}


@dataclass(frozen=True)
class GroupInfo:
    """What the pool tells admission about one ready group."""

    task_id: int | None
    min_version: int | None


@dataclass
class BatchPlan:
    """The answer to `form_batch`: which ready groups form the batch, which were stale."""

    index: int | None = None
    take: list[int] = field(default_factory=list)
    stale: list[int] = field(default_factory=list)


@dataclass
class _TagState:
    ledger: AdmissionLedger
    generating: int = 0
    holds: set[str] = field(default_factory=set)
    tail: list[Task] = field(default_factory=list)
    pooled: dict[int, Task] = field(default_factory=dict)
    formed: dict[int, list[int]] = field(default_factory=dict)
    """Batch index -> ids of its tasks, until the batch is trained (`mark_trained`)."""


class TaskAdmission(NexRLModule):
    """Admission, routing and re-queueing of rollout tasks (see module docstring)."""

    def __init__(self, policy: SamplePolicy, max_task_retries: int) -> None:
        super().__init__()
        self.policy = policy
        self.max_task_retries = max_task_retries
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # admission may have opened
        self._idle = threading.Condition(lock)  # a group stopped generating
        self._tags: dict[ModelTag, _TagState] = {}
        self._ids = itertools.count()
        # Loader hand-outs / give-backs and `_live` change together under `_io`, so a
        # checkpoint sees each task in exactly one place. Never taken while holding `_cond`.
        self._io = threading.RLock()
        self._live: dict[int, Task] = {}
        self._loader: DataLoaderLike | None = None
        self._validate_loader: DataLoaderLike | None = None
        self._validating = False

    def set_module_references(
        self, dataloader: DataLoaderLike | None, validate_dataloader: DataLoaderLike | None = None
    ) -> None:
        """The loaders tasks come from and go back to."""
        self._loader, self._validate_loader = dataloader, validate_dataloader

    def set_validating(self, on: bool) -> None:
        """While on, `acquire` hands out validation tasks (the weight-sync controller's
        `start_validate` / `end_validate`)."""
        with self._cond:  # admits no group: nobody waiting for admission is woken
            self._validating = on

    def _state(self, tag: ModelTag) -> _TagState:
        if tag not in self._tags:
            self._tags[tag] = _TagState(AdmissionLedger(self.policy))
        return self._tags[tag]

    def _count(self, name: str, n: int = 1) -> None:
        if self._activity_tracker is not None and n:
            self._activity_tracker.increment(name, n)

    # -- hand out ------------------------------------------------------------------
    def acquire(self, tag: ModelTag, wait_s: float = 0.0) -> Task | None:
        """The next task: a validation task while validating, else a training task once
        admission allows one more group (waits up to `wait_s`)."""
        with self._cond:
            validating = self._validating
        if validating:
            return self._take(self._validate_loader, validate=True)
        if not self._admit(tag, wait_s):
            return None
        task = self._take(self._loader, validate=False)
        if task is None:
            with self._cond:
                self._release(tag, generating=True)
            self.flush_tail(tag)  # the loader ran dry: candidates are served now
        return task

    def _admit(self, tag: ModelTag, wait_s: float) -> bool:
        deadline = time.monotonic() + wait_s
        with self._cond:
            state = self._state(tag)
            while state.holds or not state.ledger.acquire():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            state.generating += 1
            return True

    def _take(self, loader: DataLoaderLike | None, validate: bool) -> Task | None:
        with self._io:
            item = None if loader is None else execute(loader.get_next_item)
            if item is None:
                return None
            task = item if isinstance(item, Task) else Task(data=dict(item), is_validate=validate)
            new = task.task_id < 0
            if new:
                task.task_id = next(self._ids)
            if not validate:
                self._live[task.task_id] = task
        if new and not validate:
            self._count("tasks_in/train")
        return task

    def _settled(self, task: Task) -> None:
        """`task` left the run for good (dropped, failed): nothing to resume."""
        with self._io:
            self._live.pop(task.task_id, None)

    # -- take back -------------------------------------------------------------------
    def complete(self, tag: ModelTag, task: Task, result: StepResult) -> None:
        """Route `task` after its step answered `result` (see the module docstring)."""
        if task.is_validate:
            self._route_validate(task, result)
            return
        with self._cond:
            state = self._state(tag)
            state.generating = max(0, state.generating - 1)
            if result is StepResult.SUCCESS:  # still outstanding: admits nobody
                state.pooled[task.task_id] = task
            else:
                state.ledger.release()
                self._cond.notify_all()
            self._idle.notify_all()
        if result is StepResult.SUCCESS:
            return
        self._count(f"rollout/released/{_RELEASE_REASON[result]}")
        if result in (StepResult.REROLL, StepResult.ABORTED):
            self.requeue(task)
        elif result is StepResult.FAIL:
            self._retry_or_fail(task, "train")
        elif result is StepResult.DEFERRED:
            self._add_tail(tag, task)
        else:
            self._settled(task)
            self._count("groups_dropped/dynamic_sampling")

    def _route_validate(self, task: Task, result: StepResult) -> None:
        if result in (StepResult.SUCCESS, StepResult.DROPPED):
            return
        if result is StepResult.FAIL:
            self._retry_or_fail(task, "validate")
        else:
            self.requeue(task)

    def _retry_or_fail(self, task: Task, kind: str) -> None:
        if task.retries < self.max_task_retries:
            task.retries += 1
            self.requeue(task)
            return
        self._settled(task)
        self._count(f"tasks_failed/{kind}")
        logger.warning("task %s failed %d times; counted as failed", task.uid, task.retries + 1)

    def requeue(self, task: Task) -> None:
        """Back to the front of the task's loader: it is served before new data."""
        loader = self._validate_loader if task.is_validate else self._loader
        if loader is None:
            raise RuntimeError(f"task {task.uid!r}: no loader to give it back to")
        with self._io:
            execute(loader.add_item_front, task)
            if not task.is_validate:
                self._live.pop(task.task_id, None)

    def _release(self, tag: ModelTag, generating: bool) -> None:
        state = self._state(tag)
        state.ledger.release()
        if generating:
            state.generating = max(0, state.generating - 1)
            self._idle.notify_all()
        self._cond.notify_all()

    # -- tail batch ------------------------------------------------------------------
    def _add_tail(self, tag: ModelTag, task: Task) -> None:
        with self._cond:
            pool = self._state(tag).tail
            pool.append(task)
            full = len(pool) >= self.policy.tail_trigger
        self._count("tail_batch/candidates")
        if full:
            self.flush_tail(tag)

    def flush_tail(self, tag: ModelTag) -> int:
        """Serve every waiting candidate now, together, before new data; returns how many."""
        with self._cond:
            tasks, self._state(tag).tail = self._state(tag).tail, []
        for task in reversed(tasks):  # front insertion: keep their order
            task.tail = True
            self.requeue(task)
        if tasks:
            self._count("tail_batch/served", len(tasks))
            self._count("tail_batch/batches")
        return len(tasks)

    # -- batches ---------------------------------------------------------------------
    def form_batch(self, tag: ModelTag, groups: list[GroupInfo], need: int) -> BatchPlan:
        """Cut the next batch from the ready `groups` (in order): `need` groups, or all of
        them when `need` is 0 (the tail). Stale groups are re-queued and listed in `stale`."""
        stale_tasks: list[Task] = []
        with self._cond:
            state = self._state(tag)
            room = state.ledger.room()
            index, bound = state.ledger.formed, self.policy.staleness_threshold
            plan = BatchPlan()
            for pos, g in enumerate(groups):
                if g.min_version is not None and index - g.min_version > bound:
                    plan.stale.append(pos)
                    task = self._settle(state, g, pos)
                    if task is not None:
                        stale_tasks.append(task)
            stale = set(plan.stale)
            fresh = [p for p in range(len(groups)) if p not in stale]
            if fresh and len(fresh) >= max(need, 1):
                plan.take = fresh[:need] if need else fresh
                # one task per group, or several trajectories of one task (no grouping)
                tasks = {t for p in plan.take if (t := groups[p].task_id) is not None}
                plan.index = state.ledger.batch_formed(len(tasks) or len(plan.take))
                for task_id in tasks:
                    state.pooled.pop(task_id, None)
                state.formed[plan.index] = sorted(tasks)
            state.ledger.release(len(stale_tasks))
            if state.ledger.room() > room:
                self._cond.notify_all()
        for task in stale_tasks:
            self.requeue(task)
        self._count("staleness/dropped", len(stale_tasks))
        return plan

    def _settle(self, state: _TagState, group: GroupInfo, pos: int) -> Task | None:
        """The stale group's task, taken off the pooled list (None: settled already, by
        another trajectory of the same task when the pool does not group)."""
        if group.task_id is None:
            raise RuntimeError(
                f"stale group at position {pos} carries no `task_id`: it was not handed out "
                "by a rollout worker, so its task cannot be re-queued"
            )
        return state.pooled.pop(group.task_id, None)

    # -- end of the data ---------------------------------------------------------------
    def end_of_data(self, tag: ModelTag) -> bool:
        """No more training groups of `tag` will arrive: the loader is finished and every
        handed-out task not trained sits in a pool (a complete group) or a formed batch.
        A task between its pool put and its `complete` counts as still in flight, so the
        answer is exact, not a race on worker activity."""
        with self._io:
            if self._loader is None or not execute(self._loader.is_finished):
                return False
            with self._cond:
                placed = {i for state in self._tags.values() for i in state.pooled}
                for state in self._tags.values():
                    placed.update(i for ids in state.formed.values() for i in ids)
                return set(self._live) <= placed

    def drop_groups(self, tag: ModelTag, groups: list[GroupInfo], reason: str) -> int:
        """Settle pooled groups that will never be trained (the remainder at the end of the
        data that does not fill a batch): counted as `groups_dropped/<reason>`. Returns how
        many tasks (groups without a task id count one each)."""
        with self._cond:
            state = self._state(tag)
            ids = {g.task_id for g in groups if g.task_id is not None}
            tasks = [state.pooled.pop(i) for i in sorted(ids) if i in state.pooled]
            state.ledger.release(len(tasks))
            self._cond.notify_all()
        for task in tasks:
            self._settled(task)
        n = len(ids) + sum(g.task_id is None for g in groups)
        self._count(f"groups_dropped/{reason}", n)
        return n

    # -- exactly once across crashes -----------------------------------------------------
    def mark_trained(self, tag: ModelTag, trained: int) -> int:
        """`trained` steps are done, so batches with index < `trained` are trained: their
        tasks leave the ledger. Returns how many tasks were settled."""
        with self._cond:
            formed = self._state(tag).formed
            done = [i for i in formed if i < trained]
            ids = [task_id for i in done for task_id in formed.pop(i)]
        with self._io:
            for task_id in ids:
                self._live.pop(task_id, None)
        return len(ids)

    def checkpoint_state(self, tag: ModelTag, trained: int) -> PendingTasks:
        """The loader's state and every handed-out task not trained after `trained` steps
        (generating, pooled, in a formed batch not trained yet, tail candidates), taken
        together: `{"dataloader": state or None, "pending_tasks": [item_to_state, ...]}`."""
        with self._io:
            loader = self._loader
            state_dict = getattr(loader, "state_dict", None)  # a loader may keep no position
            loader_state = execute(state_dict) if state_dict is not None else None
            with self._cond:
                formed = self._state(tag).formed
                done = {task_id for i, ids in formed.items() if i < trained for task_id in ids}
            pending = [
                item_to_state(task)
                for task_id, task in sorted(self._live.items())
                if task_id not in done
            ]
        return {"dataloader": loader_state, "pending_tasks": pending}

    def restore(self, pending: list[JSONDict]) -> int:
        """Resume: put a checkpoint's pending tasks at the front of the loader, in their
        order (call after the loader's own state is loaded). Returns how many."""
        for state in reversed(pending):
            item = item_from_state(state)
            task = item if isinstance(item, Task) else Task(data=item)
            self.requeue(task)
        return len(pending)

    def reset(self) -> None:
        """Forget every tag's ledger and every handed-out task (a Ray rewind restores them
        from a checkpoint). Task ids keep counting, so none is reused."""
        with self._io, self._cond:
            self._tags.clear()
            self._live.clear()
            self._validating = False
            self._cond.notify_all()
            self._idle.notify_all()

    def pending_count(self) -> int:
        """Handed-out training tasks not yet trained, dropped, failed or given back."""
        with self._io:
            return len(self._live)

    # -- the weight-sync side -----------------------------------------------------------
    def set_version(self, tag: ModelTag, version: int) -> None:
        with self._cond:
            self._state(tag).ledger.set_version(version)
            self._cond.notify_all()

    def set_formed(self, tag: ModelTag, formed: int) -> None:
        """Resume: `formed` batches were trained before this run."""
        with self._cond:
            self._state(tag).ledger.formed = formed
            self._cond.notify_all()

    def hold(self, tag: ModelTag, reason: str, on: bool) -> None:
        """Stop (on) or allow (off) training admission for `reason` (a push, a validation)."""
        with self._cond:
            holds = self._state(tag).holds
            holds.add(reason) if on else holds.discard(reason)
            if not on:
                self._cond.notify_all()

    def wait_idle(self, tag: ModelTag, timeout: float | None = None) -> bool:
        """Until no admitted group of `tag` is generating (batch-async pushes wait for it),
        or `timeout` s; False if groups still generate then."""
        with self._idle:
            return self._idle.wait_for(lambda: self._state(tag).generating == 0, timeout)

    def version(self, tag: ModelTag) -> int:
        with self._cond:
            return self._state(tag).ledger.version

    def snapshot(self, tag: ModelTag) -> dict[str, int]:
        """formed / version / outstanding / generating / tail candidates (tests, metrics)."""
        with self._cond:
            state = self._state(tag)
            return {
                "formed": state.ledger.formed,
                "version": state.ledger.version,
                "outstanding": state.ledger.outstanding,
                "generating": state.generating,
                "tail_candidates": len(state.tail),
            }
