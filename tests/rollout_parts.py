"""Builds the rollout side (task owner, loader, pool, worker) from real parts, for tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nexrl.config.schema import RolloutWorkerConfig, TrajectoryPoolConfig, WeightConfig
from nexrl.data import InMemoryDataLoader
from nexrl.monitoring import ActivityTracker, ActivityTrackerProxy
from nexrl.pools import TrajectoryPool
from nexrl.rollout.admission import TaskAdmission
from nexrl.rollout.base import RolloutContext
from nexrl.rollout.sample_policy import SamplePolicy
from nexrl.rollout.workers import SingleTurnRolloutWorker
from nexrl.weight_sync import WeightSyncController


@dataclass
class RolloutSide:
    worker: SingleTurnRolloutWorker
    tasks: TaskAdmission
    wsc: WeightSyncController
    pool: TrajectoryPool
    loader: InMemoryDataLoader
    tracker: ActivityTracker


def build_task_owner(
    weight: WeightConfig,
    client: Any,
    sync_weight_path: str = "/tmp/unused",
    *,
    gpb: int | None = 1,
    max_task_retries: int = 0,
    last_step: int = 0,
    inflight_capable: bool = True,
) -> tuple[TaskAdmission, WeightSyncController]:
    """The task owner and the weight pusher, wired to each other as the builders do."""
    policy = SamplePolicy.from_config(weight, gpb, inflight_capable)
    tasks = TaskAdmission(policy, max_task_retries)
    wsc = WeightSyncController(
        weight, client, sync_weight_path, inflight_capable=inflight_capable, last_step=last_step
    )
    wsc.set_module_references(tasks)
    return tasks, wsc


def context(**overrides: Any) -> RolloutContext:
    base = dict(
        prompt_key="prompt",
        validate_temperature=0.0,
        validate_samples=1,
        source_key="data_source",
        enable_partial_rollout=False,
        tail_batch_candidate_steps=0,
        dynamic_sampling=False,
        system_prompt=None,
    )
    return RolloutContext(**{**base, **overrides})


def build_rollout_side(
    client: Any,
    items: list[dict],
    reward: Any,
    *,
    weight: WeightConfig | None = None,
    worker: RolloutWorkerConfig | None = None,
    ctx: RolloutContext | None = None,
    gpb: int = 1,
    worker_cls: type = SingleTurnRolloutWorker,
    sync_weight_path: str = "/tmp/unused",
    loader: Any = None,
) -> RolloutSide:
    weight = weight or WeightConfig()
    worker_cfg = worker or RolloutWorkerConfig(group_size=4, max_tokens=4, max_task_retries=1)
    tracker = ActivityTracker({})
    proxy = ActivityTrackerProxy(tracker)
    tasks, wsc = build_task_owner(
        weight, client, sync_weight_path, gpb=gpb, max_task_retries=worker_cfg.max_task_retries
    )
    loader = loader if loader is not None else InMemoryDataLoader({}, items=items)
    pool = TrajectoryPool(
        TrajectoryPoolConfig(
            batch_size=gpb * worker_cfg.group_size, group_size=worker_cfg.group_size
        )
    )
    ctx = ctx or context(
        enable_partial_rollout=wsc.policy.enable_partial_rollout,
        tail_batch_candidate_steps=weight.tail_batch_candidate_steps,
    )
    rollout = worker_cls(worker_cfg, client, ctx, reward)
    parts = (("tasks", tasks), ("wsc", wsc), ("pool", pool), ("loader", loader))
    for name, m in (*parts, ("rollout_0", rollout)):
        m.set_module_name(name)
        m.set_activity_tracker(proxy)
    tracker.register_module("rollout_0", rollout, is_rollout_worker=True)
    tasks.set_module_references(loader)
    pool.set_module_references(loader, tasks)
    rollout.set_module_references(pool, tasks, wsc)
    return RolloutSide(rollout, tasks, wsc, pool, loader, tracker)
