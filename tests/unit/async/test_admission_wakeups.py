"""Workers waiting for admission wake only when a change can admit one of them.

In a sync step every rollout worker finishes its group and waits for the next
version; each group reaching the pool used to wake every worker already waiting,
which found no room and slept again (84 wake-ups a step with 16 workers, 33 now).
"""

from __future__ import annotations

import threading
import time

import pytest

from nexrl.data.base import InMemoryDataLoader
from nexrl.rollout.admission import GroupInfo, TaskAdmission
from nexrl.rollout.sample_policy import AdmissionLedger, SamplePolicy
from nexrl.types import StepResult, Task

TAG = "default"
GROUPS = 2  # groups per batch; sync: staleness 0


class CountingCondition(threading.Condition):
    """A condition that counts how often a waiter returns from `wait`."""

    def __init__(self, lock) -> None:
        super().__init__(lock)
        self.wakeups = 0
        self.waiting = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting += 1  # under the lock, as every change here
        woken = super().wait(timeout)
        self.waiting -= 1
        self.wakeups += 1
        return woken


def _admission() -> tuple[TaskAdmission, CountingCondition]:
    admission = TaskAdmission(SamplePolicy(groups_per_batch=GROUPS), max_task_retries=0)
    admission.set_module_references(
        InMemoryDataLoader(items=[{"prompt": f"p{i}"} for i in range(20)])
    )
    counting = CountingCondition(admission._cond._lock)  # waiters sleep on this one
    admission._cond = counting
    return admission, counting


def _waiters(admission: TaskAdmission, n: int) -> tuple[list[threading.Thread], list[Task]]:
    got: list[Task] = []

    def wait() -> None:
        task = admission.acquire(TAG, wait_s=10.0)
        if task is not None:
            got.append(task)

    threads = [threading.Thread(target=wait, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, got


def _until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@pytest.mark.timeout(30)
def test_groups_reaching_the_pool_do_not_wake_waiting_workers_and_a_new_version_admits():
    admission, counting = _admission()
    running = [admission.acquire(TAG) for _ in range(GROUPS)]
    assert all(running) and admission.snapshot(TAG)["outstanding"] == GROUPS
    threads, got = _waiters(admission, 3)
    assert _until(lambda: counting.waiting == 3)

    for task in running:  # both groups land in the pool: still outstanding, no room
        admission.complete(TAG, task, StepResult.SUCCESS)
    assert admission.wait_idle(TAG, timeout=5.0)  # idle waiters do hear of it
    time.sleep(0.05)
    assert counting.wakeups == 0 and got == []

    plan = admission.form_batch(TAG, [GroupInfo(t.task_id, None) for t in running], GROUPS)
    assert plan.index == 0
    time.sleep(0.05)
    assert counting.wakeups == 0  # formed but not trained: the room is still zero

    admission.set_version(TAG, 1)  # the step's weights serve: room for GROUPS groups
    assert _until(lambda: len(got) == GROUPS)
    assert _until(lambda: counting.waiting == 1)  # the third sleeps on
    admission.hold(TAG, "push", on=False)  # lifting a hold wakes it to look again
    assert _until(lambda: counting.wakeups == 4)
    assert len(got) == GROUPS
    admission.complete(TAG, got[0], StepResult.ABORTED)  # capacity released: admitted
    assert _until(lambda: len(got) == GROUPS + 1)
    for t in threads:
        t.join(timeout=5.0)
    assert not any(t.is_alive() for t in threads)


@pytest.mark.timeout(30)
def test_a_stale_group_dropped_while_a_batch_forms_admits_a_waiting_worker():
    admission, counting = _admission()
    running = [admission.acquire(TAG) for _ in range(GROUPS)]
    threads, got = _waiters(admission, 1)
    assert _until(lambda: counting.waiting == 1)
    for task in running:
        admission.complete(TAG, task, StepResult.SUCCESS)
    stale = GroupInfo(running[0].task_id, min_version=-1)  # older than the bound allows
    plan = admission.form_batch(TAG, [stale, GroupInfo(running[1].task_id, 0)], GROUPS)
    assert plan.stale == [0] and plan.index is None  # one fresh group cannot fill it
    assert _until(lambda: got != [], timeout=2.0)  # its place is free: no 10 s wait
    assert got[0].task_id == running[0].task_id  # the stale task, served again first
    threads[0].join(timeout=5.0)


@pytest.mark.timeout(30)
def test_a_hold_being_set_wakes_nobody_and_its_release_does():
    admission, counting = _admission()
    admission.hold(TAG, "validation", on=True)
    threads, got = _waiters(admission, 2)
    assert _until(lambda: counting.waiting == 2)
    admission.hold(TAG, "push", on=True)
    time.sleep(0.05)
    assert counting.wakeups == 0
    admission.hold(TAG, "push", on=False)  # "validation" still holds
    assert _until(lambda: counting.wakeups == 2)
    assert got == []
    admission.hold(TAG, "validation", on=False)
    assert _until(lambda: len(got) == 2)
    for t in threads:
        t.join(timeout=5.0)


def test_the_ledger_room_is_what_acquire_grants():
    ledger = AdmissionLedger(SamplePolicy(groups_per_batch=GROUPS, over_sample_threshold=0.5))
    assert ledger.room() == GROUPS + 1  # one over-sent group
    granted = 0
    while ledger.acquire():
        granted += 1
    assert granted == GROUPS + 1 and ledger.room() == 0
    ledger.batch_formed(GROUPS)
    assert ledger.room() == 0  # lag 1: only the extra group's place, taken by the third
    ledger.set_version(1)
    assert ledger.room() == GROUPS  # the third group is still outstanding
    assert AdmissionLedger(SamplePolicy()).room() == float("inf")  # admission off
