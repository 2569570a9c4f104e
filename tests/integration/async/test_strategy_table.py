"""Seed 003's strategy table, one test per row, with the real engine, worker, pool, loader.

A weight push arrives while a rollout is generating: `Engine(emulated_step_latency_s=...)` (a sleep
per engine step) keeps the request running long enough for the push to find it.
"""

import threading
import time

import pytest

from nexrl.config.schema import RolloutWorkerConfig, WeightConfig
from nexrl.inference.client import LLMServiceClient
from nexrl.inference.engine import Engine
from nexrl.rewards import shift_letters
from nexrl.types import StepResult
from tests.rollout_parts import build_rollout_side

MAX_TOKENS = 24


@pytest.fixture
def engine(tiny_model_path):
    eng = Engine(tiny_model_path, emulated_step_latency_s=0.02, max_batch_size=16)
    yield eng
    eng.shutdown()


def build(engine, path, k=1, f=0.0, partial=False, tail_steps=0, trigger=0, gpb=2):
    client = LLMServiceClient({"backend": "builtin", "model": path}, engine=engine)
    weight = WeightConfig(
        sync_mode="fully-async",
        staleness_threshold=k,
        over_sample_threshold=f,
        enable_partial_rollout=partial,
        tail_batch_candidate_steps=tail_steps,
        tail_batch_trigger_size=trigger,
        inflight_weight_update=False,  # the table is about what a push's aborts do
        abort_grace_s=0.0,
    )
    words = ("abcd", "bcde", "cdef", "defg", "efgh", "fghi", "ghij", "hijk")
    items = [{"prompt": f"{w}>", "answer": w} for w in words]
    worker = RolloutWorkerConfig(group_size=2, max_tokens=MAX_TOKENS, max_task_retries=0)
    side = build_rollout_side(
        client, items, shift_letters, weight=weight, worker=worker, gpb=gpb, sync_weight_path=path
    )
    return side.worker, side.tasks, side.wsc, side.pool, side.loader, side.tracker


def loop_with_push(worker, wsc, engine):
    """Run one worker loop; push new weights once the request has generated a few tokens."""
    start = engine.stats["generated_tokens"]
    thread = threading.Thread(target=worker._loop_once)
    thread.start()
    deadline = time.monotonic() + 20
    while engine.stats["generated_tokens"] < start + 4 and time.monotonic() < deadline:
        time.sleep(0.002)
    wsc.train_worker_notify_weight_update("train_worker_0", "default")
    thread.join(30)
    assert not thread.is_alive()


def test_synchronous_strategy_sends_no_extra_data(engine, tiny_model_path):
    """staleness 0, no partial, no tail: exactly one batch worth of groups in flight."""
    _, owner, *_ = build(engine, tiny_model_path, k=0, f=0.0)
    assert [owner.acquire("default") is not None for _ in range(3)] == [True, True, False]


def test_async_1_over_sends_and_serves_aborted_tasks_first(engine, tiny_model_path):
    """20% over-sending; responses dropped at the push; the aborted task is served next."""
    worker, owner, wsc, pool, loader, tracker = build(engine, tiny_model_path, k=0, f=0.2, gpb=5)
    assert owner.snapshot("default")["outstanding"] == 0
    tasks = [owner.acquire("default") for _ in range(8)]
    admitted = [t for t in tasks if t is not None]
    assert len(admitted) == 6  # 5 + ceil(0.2 * 5)
    for task in reversed(admitted):  # give them back: the front is 0, 1, ... again
        owner.complete("default", task, StepResult.REROLL)
    loop_with_push(worker, wsc, engine)
    assert pool.is_empty()  # nothing kept from the aborted generation
    first = loader.get_next_item()
    assert first.data["index"] == 0 and first.aborts == 1  # the abort queue comes first
    assert tracker.get_counters()["rollout/aborted_groups"] == 1
    assert owner.snapshot("default")["outstanding"] == 0  # its slot was given back


def test_async_2_tail_candidate_after_candidate_steps_plus_one_aborts(engine, tiny_model_path):
    """No partial, tail_batch_candidate_steps=1: the 2nd abort moves the task to the pool."""
    worker, owner, wsc, pool, loader, _ = build(engine, tiny_model_path, tail_steps=1, trigger=2)
    loop_with_push(worker, wsc, engine)
    assert loader.returned_items()[0].aborts == 1  # first abort: re-queued
    loop_with_push(worker, wsc, engine)
    assert loader.returned_items() == []
    assert owner.snapshot("default")["tail_candidates"] == 1  # waits for a 2nd candidate
    assert owner.flush_tail("default") == 1
    served = loader.returned_items()[0]
    assert served.tail and served.partial is None
    loop_with_push(worker, wsc, engine)  # a tail task is not aborted out again
    assert pool.num_ready() == 2


def check_concatenated(traj):
    ids, lps, vers = traj["response_ids"], traj["response_logprobs"], traj["token_versions"]
    assert len(ids) == len(lps) == len(vers) <= MAX_TOKENS
    assert vers == sorted(vers)  # old-version prefix, then the new version


def test_async_3_partial_rollout_keeps_and_concatenates(engine, tiny_model_path):
    """Partial rollout: the aborted samples continue on the new weights, one sample each."""
    worker, owner, wsc, pool, _, tracker = build(engine, tiny_model_path, partial=True)
    loop_with_push(worker, wsc, engine)
    group = pool.get_batch(2).to_trajectories()
    assert len(group) == 2
    for traj in group:
        check_concatenated(traj)
    spans = [set(t["token_versions"]) for t in group]
    assert any(s == {0, 1} for s in spans)  # a sample generated on both versions
    assert all(t["model_version"] == 0 for t in group)
    counters = tracker.get_counters()
    assert counters["rollout/aborted_groups"] == 1
    assert counters["rollout/partial_continuations"] >= 1


def test_async_4_partial_tail_candidate_keeps_its_tokens(engine, tiny_model_path):
    """Partial + tail_batch_candidate_steps=1: the 2nd abort defers the partial sample."""
    worker, owner, wsc, pool, loader, _ = build(
        engine, tiny_model_path, partial=True, tail_steps=1, trigger=1
    )
    loop_with_push(worker, wsc, engine)  # abort 1: continued (partial)
    assert pool.num_ready() == 2
    pool.clear()
    # a second task meets two pushes: the 2nd abort exceeds candidate_steps
    thread = threading.Thread(target=worker._loop_once)
    start = engine.stats["generated_tokens"]
    thread.start()
    for _ in range(2):
        while engine.stats["generated_tokens"] < start + 4:
            time.sleep(0.002)
        wsc.train_worker_notify_weight_update("train_worker_0", "default")
        start = engine.stats["generated_tokens"]
    thread.join(30)
    served = loader.returned_items()[0]  # trigger 1: served at once
    assert served.tail and served.aborts == 2
    kept = served.partial
    assert any(len(c["response_ids"]) > 0 for c in kept)  # tokens kept across the deferral
    loop_with_push(worker, wsc, engine)  # the tail task resumes from its partial
    for traj in pool.get_batch(2).to_trajectories():
        check_concatenated(traj)
