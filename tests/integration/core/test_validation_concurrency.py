"""Validation tasks run side by side in one rollout worker (`validate.concurrency`), on
the real in-process engine, task owner, loaders and validator."""

import asyncio
import functools
import threading
import time

import pytest

from nexrl.agents.workflows import SingleTurnWorkflow
from nexrl.config.schema import RolloutWorkerConfig
from nexrl.data import InMemoryDataLoader
from nexrl.inference.client import LLMServiceClient
from nexrl.rewards import shift_letters
from nexrl.rollout.agent import AgentRolloutWorker
from nexrl.rollout.workers import SingleTurnRolloutWorker
from nexrl.validation import Validator
from tests.rollout_parts import build_rollout_side, context

TRAIN = [{"prompt": "abcd>", "answer": "bcde"}]
VALIDATE = [{"prompt": f"{c}bcd>", "answer": "x"} for c in "abcdefgh"]


@pytest.fixture
def client(tiny_model_path):
    return LLMServiceClient({"backend": "builtin", "model": tiny_model_path, "model_tag": "t"})


class InFlight:
    """Wraps the client's `completion`: counts the calls in flight at once and, with
    `meet`, holds each call until that many have arrived (a barrier that fails the call
    when they do not come within a few seconds)."""

    def __init__(self, client, meet: int = 0) -> None:
        self._completion, self._lock = client.completion, threading.Lock()
        self._barrier = threading.Barrier(meet, timeout=10) if meet else None
        self.now = self.most = 0
        client.completion = self

    def __call__(self, *args, **kwargs):
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            if self._barrier is not None:
                self._barrier.wait()
            time.sleep(0.01)  # a slower engine: calls that can overlap do
            return self._completion(*args, **kwargs)
        finally:
            with self._lock:
                self.now -= 1


def validate(client, tasks_per_worker: int, worker_cls=SingleTurnRolloutWorker):
    cfg = RolloutWorkerConfig(group_size=2, max_tokens=4, max_task_retries=0)
    ctx = context(validate_tasks_per_worker=tasks_per_worker)
    side = build_rollout_side(
        client, TRAIN, shift_letters, worker=cfg, ctx=ctx, worker_cls=worker_cls
    )
    loader = InMemoryDataLoader({}, is_validate=True, items=VALIDATE)
    validator = Validator()
    validator.set_activity_tracker(side.worker._activity_tracker)
    side.tasks.set_module_references(side.loader, loader)
    side.worker.set_module_references(side.pool, side.tasks, side.wsc, validator)
    validator.begin(len(VALIDATE))
    side.wsc.start_validate("t")
    side.worker.begin_validate()
    deadline = time.monotonic() + 60
    while not validator.is_complete() and time.monotonic() < deadline:
        side.worker._loop_once() or time.sleep(0.01)  # the worker's own loop
    side.worker.end_validate()
    side.wsc.end_validate("t")
    return side, validator


def test_a_worker_runs_its_validation_tasks_side_by_side(client):
    calls = InFlight(client, meet=4)  # fails unless 4 tasks are in the engine together
    side, validator = validate(client, tasks_per_worker=4)
    trajectories = validator._trajectories
    assert len(trajectories) == len(VALIDATE) and calls.most == 4
    assert side.tracker.get_counters().get("tasks_failed/validate", 0) == 0
    # each trajectory carries its own task: `current_task` is per thread
    assert len({t["task_id"] for t in trajectories}) == len(VALIDATE)
    assert sorted(t["prompt"] for t in trajectories) == sorted(r["prompt"] for r in VALIDATE)
    assert side.worker.health_check()
    assert not side.worker._helpers.busy  # the helpers are parked
    assert side.tasks.acquire("t").is_validate is False  # training resumes
    side.worker.stop()


def test_one_task_per_worker_without_helpers(client):
    calls = InFlight(client)
    _, validator = validate(client, tasks_per_worker=1)
    assert len(validator._trajectories) == len(VALIDATE) and calls.most == 1


class CustomWorker(SingleTurnRolloutWorker):
    """A worker written as users write them: `concurrent_steps` not declared."""

    concurrent_steps = False


def test_a_worker_that_does_not_declare_concurrent_steps_runs_one_task_at_a_time(client):
    calls = InFlight(client)
    _, validator = validate(client, tasks_per_worker=4, worker_cls=CustomWorker)
    assert len(validator._trajectories) == len(VALIDATE) and calls.most == 1


def test_a_helper_that_dies_fails_the_workers_health_check(client):
    side, _ = validate(client, tasks_per_worker=2)
    side.worker._loop.stop()  # the test drives the loop itself

    def broken(tag, wait_s=0.0):
        raise ConnectionError("task owner unreachable")

    side.tasks.acquire = broken
    side.wsc.start_validate("t")
    side.worker.begin_validate()
    assert side.worker._helpers.wait(10)
    side.worker.end_validate()
    assert isinstance(side.worker._helpers.error, ConnectionError)
    assert not side.worker.health_check()
    side.worker.stop()


class MeetOnOneLoop(SingleTurnWorkflow):
    """Single-turn episodes that first meet at an asyncio barrier of `meet` episodes (it
    breaks unless that many tasks' episodes run on one loop at once) and note their loop."""

    def __init__(self, meet: int) -> None:
        super().__init__(max_tokens=4)
        self.barrier, self.loops = asyncio.Barrier(meet), set()

    async def arun_episode(self, engine, data):
        self.loops.add(asyncio.get_running_loop())
        await asyncio.wait_for(self.barrier.wait(), timeout=10)
        return await super().arun_episode(engine, data)


def test_the_agent_worker_validates_several_tasks_on_its_one_event_loop(client):
    calls = InFlight(client)
    workflow = MeetOnOneLoop(meet=4)
    agent = functools.partial(AgentRolloutWorker, workflow=workflow)
    side, validator = validate(client, tasks_per_worker=4, worker_cls=agent)
    assert len(validator._trajectories) == len(VALIDATE) and calls.most == 4
    assert side.tracker.get_counters().get("tasks_failed/validate", 0) == 0
    assert len({t["task_id"] for t in validator._trajectories}) == len(VALIDATE)
    assert len(workflow.loops) == 1  # every task's episodes, one loop
    side.worker.stop()
    assert next(iter(workflow.loops)).is_closed()
