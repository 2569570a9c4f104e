"""Seed 003's strategy table, one test per row, with the real engine, worker, pool, loader.

A weight push arrives while a rollout is generating: `Engine(emulated_step_latency_s=...)` (a sleep
per engine step) keeps the request running long enough for the push to find it.
"""

import threading
import time

import pytest

from nexrl.data import InMemoryDataLoader
from nexrl.inference.client import LLMServiceClient
from nexrl.inference.engine import Engine
from nexrl.monitoring import ActivityTracker, ActivityTrackerProxy
from nexrl.pools import TrajectoryPool
from nexrl.rewards import shift_letters
from nexrl.rollout.workers import ABORTS_KEY, PARTIAL_KEY, SingleTurnRolloutWorker
from nexrl.weight_sync import TAIL_KEY, WeightSyncController

MAX_TOKENS = 24


@pytest.fixture
def engine(tiny_model_path):
    eng = Engine(tiny_model_path, emulated_step_latency_s=0.02, max_batch_size=16)
    yield eng
    eng.shutdown()


def build(engine, path, k=1, f=0.0, partial=False, tail_steps=0, trigger=0, gpb=2):
    tracker = ActivityTracker({})
    proxy = ActivityTrackerProxy(tracker)
    client = LLMServiceClient({"backend": "builtin", "model": path}, engine=engine)
    policy = {
        "sync_mode": "fully-async",
        "staleness_threshold": k,
        "over_sample_threshold": f,
        "enable_partial_rollout": partial,
        "tail_batch_candidate_steps": tail_steps,
        "tail_batch_trigger_size": trigger,
        "groups_per_batch": gpb,
    }
    wsc = WeightSyncController(policy, client, path)
    items = [{"prompt": f"{w}>", "answer": w} for w in ("abcd", "bcde", "cdef", "defg")]
    loader = InMemoryDataLoader({}, items=items)
    pool = TrajectoryPool({"batch_size": 2 * gpb, "group_size": 2, "key_list": ["uid"]})
    cfg = {"group_size": 2, "max_tokens": MAX_TOKENS, **policy}
    worker = SingleTurnRolloutWorker(cfg, client, shift_letters)
    for name, m in (("wsc", wsc), ("pool", pool), ("loader", loader), ("rollout_0", worker)):
        m.set_module_name(name)
        m.set_activity_tracker(proxy)
    pool.set_module_references(loader, wsc)
    wsc.set_module_references(loader, pool)
    worker.set_module_references(pool, loader, wsc)
    return worker, wsc, pool, loader, tracker


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
    _, wsc, *_ = build(engine, tiny_model_path, k=0, f=0.0)
    assert [wsc.acquire_rollout("default") for _ in range(3)] == [True, True, False]


def test_async_1_over_sends_and_serves_aborted_tasks_first(engine, tiny_model_path):
    """20% over-sending; responses dropped at the push; the aborted task is served next."""
    worker, wsc, pool, loader, tracker = build(engine, tiny_model_path, k=0, f=0.2, gpb=5)
    assert wsc.get_admission_state()["outstanding"] == 0
    assert sum(wsc.acquire_rollout("default") for _ in range(8)) == 6  # 5 + ceil(0.2 * 5)
    for _ in range(6):
        wsc.release_rollout("default")
        wsc.finish_generation("default")
    loop_with_push(worker, wsc, engine)
    assert pool.is_empty()  # nothing kept from the aborted generation
    first = loader.get_next_item()
    assert first["index"] == 0 and first[ABORTS_KEY] == 1  # the abort queue comes first
    assert tracker.get_counters()["rollout/aborted_groups"] == 1
    assert wsc.get_admission_state()["outstanding"] == 0  # its slot was given back


def test_async_2_tail_candidate_after_candidate_steps_plus_one_aborts(engine, tiny_model_path):
    """No partial, tail_batch_candidate_steps=1: the 2nd abort moves the task to the pool."""
    worker, wsc, pool, loader, _ = build(engine, tiny_model_path, tail_steps=1, trigger=2)
    loop_with_push(worker, wsc, engine)
    assert loader.returned_items()[0][ABORTS_KEY] == 1  # first abort: re-queued
    loop_with_push(worker, wsc, engine)
    assert loader.returned_items() == []
    assert wsc.get_admission_state()["tail_candidates"] == 1  # waits for a 2nd candidate
    assert wsc.flush_tail_candidates("default") == 1
    served = loader.returned_items()[0]
    assert served[TAIL_KEY] and PARTIAL_KEY not in served
    loop_with_push(worker, wsc, engine)  # a tail task is not aborted out again
    assert pool.num_ready() == 2


def check_concatenated(traj):
    ids, lps, vers = traj["response_ids"], traj["response_logprobs"], traj["token_versions"]
    assert len(ids) == len(lps) == len(vers) <= MAX_TOKENS
    assert vers == sorted(vers)  # old-version prefix, then the new version


def test_async_3_partial_rollout_keeps_and_concatenates(engine, tiny_model_path):
    """Partial rollout: the aborted samples continue on the new weights, one sample each."""
    worker, wsc, pool, _, tracker = build(engine, tiny_model_path, partial=True)
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
    worker, wsc, pool, loader, _ = build(
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
    assert served[TAIL_KEY] and served[ABORTS_KEY] == 2
    kept = served[PARTIAL_KEY]
    assert any(len(c["response_ids"]) > 0 for c in kept)  # tokens kept across the deferral
    loop_with_push(worker, wsc, engine)  # the tail task resumes from its partial
    for traj in pool.get_batch(2).to_trajectories():
        check_concatenated(traj)
