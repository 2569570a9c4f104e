"""`TaskAdmission` knows every handed-out training task until it is trained.

A checkpoint (`checkpoint_state`) must hold each task of the epoch in exactly
one place: not drawn yet (loader position), in the loader's returned queue,
pending (handed out, not trained), trained, or settled (dropped). Resuming from
it (`restore` after `load_state_dict`) hands out exactly the rest.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter

from nexrl.data.base import InMemoryDataLoader, item_from_state
from nexrl.rollout.admission import GroupInfo, TaskAdmission
from nexrl.rollout.sample_policy import SamplePolicy
from nexrl.types import StepResult, Task

TAG = "default"


def _setup(n: int, trigger: int = 5) -> tuple[TaskAdmission, InMemoryDataLoader]:
    loader = InMemoryDataLoader(items=[{"prompt": f"p{i}"} for i in range(n)])
    admission = TaskAdmission(SamplePolicy(tail_batch_trigger_size=trigger), max_task_retries=100)
    admission.set_module_references(loader)
    return admission, loader


def _uid(state: dict) -> str:
    item = item_from_state(state)
    return item.uid if isinstance(item, Task) else item["uid"]


def _not_drawn(loader_state: dict, n: int) -> list[str]:
    return [f"0-{i}" for i in range(loader_state["position"], n)]


def _places(snapshot: dict, n: int) -> Counter:
    """uid -> times it is somewhere the resumed run will hand it out again."""
    loader = snapshot["dataloader"]
    uids = _not_drawn(loader, n) + [_uid(s) for s in loader["returned"]]
    return Counter(uids + [_uid(s) for s in snapshot["pending_tasks"]])


def _form(admission: TaskAdmission, tasks: list[Task]) -> int:
    plan = admission.form_batch(TAG, [GroupInfo(t.task_id, None) for t in tasks], len(tasks))
    assert plan.take == list(range(len(tasks)))
    return plan.index


def test_checkpoint_holds_every_untrained_task_once_and_resume_hands_out_the_rest():
    admission, loader = _setup(12)
    t = [admission.acquire(TAG) for _ in range(8)]
    for task in t[:3]:
        admission.complete(TAG, task, StepResult.SUCCESS)
    assert _form(admission, t[:2]) == 0  # batch 0: t0, t1 (formed, not trained)
    admission.complete(TAG, t[3], StepResult.DEFERRED)  # tail candidate
    admission.complete(TAG, t[4], StepResult.REROLL)  # back in the loader's queue
    admission.complete(TAG, t[5], StepResult.DROPPED)  # settled for good
    # t2 pooled, t6 and t7 generating

    before = admission.checkpoint_state(TAG, trained=0)
    pending = {_uid(s) for s in before["pending_tasks"]}
    assert pending == {t[i].uid for i in (0, 1, 2, 3, 6, 7)}
    assert [_uid(s) for s in before["dataloader"]["returned"]] == [t[4].uid]

    snap = json.loads(json.dumps(admission.checkpoint_state(TAG, trained=1)))  # batch 0 trained
    assert {_uid(s) for s in snap["pending_tasks"]} == {t[i].uid for i in (2, 3, 6, 7)}
    trained = {t[0].uid, t[1].uid}
    places = _places(snap, 12)
    assert set(places.values()) == {1}
    assert set(places) | trained | {t[5].uid} == {f"0-{i}" for i in range(12)}
    assert not set(places) & (trained | {t[5].uid})

    # resume into a fresh loader and admission
    admission2, loader2 = _setup(12)
    loader2.load_state_dict(snap["dataloader"])
    assert admission2.restore(snap["pending_tasks"]) == 4
    served = []
    while (task := admission2.acquire(TAG)) is not None:
        served.append(task)
    assert Counter(x.uid for x in served) == places
    tail = next(x for x in served if x.uid == t[3].uid)
    rerolled = next(x for x in served if x.uid == t[4].uid)
    assert len({x.task_id for x in served}) == len(served)  # fresh ids in the new process
    assert (tail.retries, rerolled.retries) == (0, 0)


def test_trained_batches_leave_the_ledger():
    admission, _ = _setup(6)
    tasks = [admission.acquire(TAG) for _ in range(4)]
    for task in tasks:
        admission.complete(TAG, task, StepResult.SUCCESS)
    _form(admission, tasks[:2])
    _form(admission, tasks[2:])
    assert admission.pending_count() == 4
    assert admission.mark_trained(TAG, 1) == 2
    assert admission.pending_count() == 2
    assert admission.mark_trained(TAG, 1) == 0
    assert admission.mark_trained(TAG, 2) == 2
    assert admission.pending_count() == 0


def test_failed_and_stale_tasks_are_in_one_place():
    admission, loader = _setup(4)
    admission.max_task_retries = 0
    a, b = admission.acquire(TAG), admission.acquire(TAG)
    admission.complete(TAG, a, StepResult.FAIL)  # no retry left: counted failed
    admission.complete(TAG, b, StepResult.SUCCESS)
    plan = admission.form_batch(TAG, [GroupInfo(b.task_id, -5)], 1)  # stale: re-queued
    assert plan.stale == [0]
    snap = admission.checkpoint_state(TAG, trained=0)
    assert snap["pending_tasks"] == []
    assert _places(snap, 4) == Counter(["0-2", "0-3", b.uid])


def test_concurrent_checkpoints_see_each_task_exactly_once():
    """Workers hand out, re-roll, fail, defer and finish tasks while batches form, train
    and checkpoints are taken: every snapshot partitions the epoch exactly."""
    n = 60
    admission, _ = _setup(n, trigger=3)
    rng = random.Random(7)
    done = threading.Event()
    successes: list[Task] = []
    lock = threading.Lock()

    def work(seed: int) -> None:
        r = random.Random(seed)
        while not done.is_set():
            task = admission.acquire(TAG)
            if task is None:
                time.sleep(0.001)
                continue
            result = r.choice([StepResult.SUCCESS] * 3 + [StepResult.REROLL, StepResult.FAIL])
            if r.random() < 0.1 and not task.tail:
                result = StepResult.DEFERRED
            admission.complete(TAG, task, result)
            if result is StepResult.SUCCESS:
                with lock:
                    successes.append(task)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for w in workers:
        w.start()
    batches: dict[int, list[str]] = {}
    trained = 0
    checked = 0
    try:
        while sum(len(u) for u in batches.values()) < n:
            with lock:
                ready = successes[:2] if len(successes) >= 2 else []
                del successes[: len(ready)]
            if ready:
                batches[_form(admission, ready)] = [x.uid for x in ready]
            if batches and rng.random() < 0.5 and trained < len(batches):
                trained += 1
                admission.mark_trained(TAG, trained)
            if sum(len(u) for u in batches.values()) == n - 1:  # the last one alone
                with lock:
                    last, successes[:] = successes[:], []
                if last:
                    batches[_form(admission, last)] = [x.uid for x in last]
            if not ready:
                time.sleep(0.001)
            snap = admission.checkpoint_state(TAG, trained)
            gone = Counter(u for i in range(trained) for u in batches[i])
            whole = _places(snap, n) + gone
            want = Counter(f"0-{i}" for i in range(n))
            assert whole == want, f"extra {whole - want}, lost {want - whole}"

            checked += 1
    finally:
        done.set()
        for w in workers:
            w.join()
    assert checked > 10
