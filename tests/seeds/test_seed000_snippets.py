"""Seed 000's usage snippets (activity tracking, debugging tools) and the names it documents
that no other test covered: TrajectoryPoolInstance's seed methods, get_batch_any,
easy_dump, _put_rollout_task, set_train_step, SimpleRolloutWorker, resume.mode=from_path.
Changes to a snippet are marked `# CHANGED:`."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from nexrl import BaseRolloutWorker, Batch, GRPOProcessor, NexRLController, NexRLRole
from nexrl.config import load_config
from nexrl.config.schema import TrajectoryPoolConfig
from nexrl.execute import execute
from nexrl.pools.trajectory_pool import PoolRefs, TrajectoryPool, TrajectoryPoolInstance
from nexrl.types import Task
from tests.unit.core.test_weight_sync import make as make_weight_sync


def traj(uid: str, tag: str = "default") -> dict:
    return {
        "uid": uid,
        "prompt_ids": [1],
        "response_ids": [2],
        "response_logprobs": [0.0],
        "reward": 1.0,
        "model_tag": tag,
    }


def test_trajectory_pool_instance_seed_methods():
    tasks, _, pool, _ = make_weight_sync()
    config = TrajectoryPoolConfig(batch_size=2, group_size=1, key_list=[])
    inst = TrajectoryPoolInstance("default", config, PoolRefs())
    tracker = pool._activity_tracker
    inst.set_module_references(pool._refs.dataloader, tasks, tracker)
    assert (inst._refs.dataloader, inst._refs.admission, inst._refs.tracker) == (
        pool._refs.dataloader,
        tasks,
        tracker,
    )
    assert inst.put_trajectory(traj("a")) == "success"
    inst.notify_weight_sync_starting()
    assert inst.put_trajectory(traj("b")) == "re-rollout"
    inst.unlock_for_weight_sync()
    assert inst.put_trajectory(traj("b")) == "success"
    assert inst.put_trajectory({"uid": "bad"}) == "fail"  # malformed: refused and reported
    assert len(inst) == 2


def test_weight_sync_controller_batch_ready_alias_reports_the_admission_state():
    tasks, wsc, _, _ = make_weight_sync()
    assert wsc.trajectory_pool_notify_batch_ready("default") == tasks.snapshot("default")


def test_get_batch_any_takes_a_batch_from_whichever_tag_has_one():
    pool = TrajectoryPool(TrajectoryPoolConfig(batch_size=2, group_size=1, key_list=[]))
    pool.put_trajectory(traj("a", "policy_b"))
    assert pool.get_batch_any() is None  # one of two
    pool.put_trajectory(traj("b", "policy_b"))
    pool.put_trajectory(traj("c", "policy_a"))
    batch = pool.get_batch_any()
    assert batch is not None and batch.values["uid"] == ["a", "b"]
    assert pool.get_model_tags() == ["policy_b", "policy_a"] or set(pool.get_model_tags()) == {
        "policy_a",
        "policy_b",
    }


@pytest.fixture
def controller(small_overrides):
    ctl = NexRLController(load_config([*small_overrides, "logger.backend=[jsonl]"]))
    yield ctl
    ctl.system.activity_tracker.close()


def test_activity_tracking_and_debugging_snippets(controller, caplog):
    s = controller.system
    worker = s.rollout_workers[0]
    worker._activity_tracker.set_training_step(7)

    # ---- seed: "Activity Tracking Usage", in a module with an activity tracker ----
    self = worker
    with self._activity_tracker.track("MyModule", "processing_data"):
        result = sum(range(10))
        assert "MyModule" in controller.activity_tracker.get_running_status_summary()
    if self._activity_tracker.is_rollout_worker_quiescent():
        logging.getLogger("seed").info("All rollout workers are idle")
    self._activity_tracker.experiment_logger_post(
        backend="jsonl",  # CHANGED: "wandb" -> a backend this run has (logger.backend)
        data={"metric_name": result},
        step=7,  # CHANGED: `training_step` is the snippet's free variable
    )

    # ---- seed: "Debugging Tools / Activity Monitoring" ----
    status = controller.activity_tracker.get_running_status_summary()
    print(f"System status: {status}")
    health = controller.activity_tracker.get_error_health_status()
    print(f"Health status: {health}")
    # ---- seed: "Module health" ----
    for module_name, _module_ref in controller.activity_tracker._module_refs.items():
        is_alive = controller.activity_tracker.check_module_liveness()
        print(f"{module_name}: {'alive' if is_alive else 'dead'}")
    # ---- seed: "Error Analysis" ----
    error_reporter = controller.activity_tracker.error_reporter  # CHANGED: named in the seed only
    health_status = error_reporter.get_health_status()
    if health_status["status"] != "healthy":
        print(f"System unhealthy: {health_status['message']}")

    assert health["status"] == health_status["status"] == "healthy"
    assert is_alive and len(controller.activity_tracker._module_refs) >= 5
    controller.activity_tracker.close()
    lines = (Path(controller.run_dir) / "metrics.jsonl").read_text().splitlines()
    assert any(json.loads(x).get("metric_name") == 45 for x in lines)


def test_easy_dump_and_put_rollout_task(controller, caplog):
    s = controller.system
    worker = s.rollout_workers[0]
    with caplog.at_level(logging.DEBUG, logger="nexrl.module"):
        text = worker.easy_dump({"a": 1, "b": 2}, keys=["a"], value_formatter=json.dumps)
    assert text.endswith('{"a": 1}') and worker.get_module_name() in text
    assert text in caplog.text
    # _put_rollout_task: the task goes back to the front of the loader
    assert worker._put_rollout_task({"prompt": "again", "uid": "x"}) is True
    task = execute(s.task_admission.acquire, "default")
    assert task is not None and task.data["prompt"] == "again"


def test_seed_roles_cover_the_built_modules(controller):
    assert {r.value for r in NexRLRole} >= {"rollout_worker", "train_worker", "validator"}


def metric_steps(run_dir) -> list[int]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [x["step"] for x in map(json.loads, lines) if "train/loss" in x]


@pytest.mark.slow
def test_resume_from_path_sets_the_train_step(small_overrides, tmp_path):
    first = NexRLController(load_config([*small_overrides, "train_worker.total_train_steps=2"]))
    first.run()
    assert metric_steps(first.run_dir) == [1, 2]
    ckpt = next(Path(first.run_dir).rglob("global_step_2"))
    second = NexRLController(
        load_config(
            [
                *small_overrides,
                f"run_dir={tmp_path / 'second'}",
                "resume.mode=from_path",
                f"resume.resume_path={ckpt}",
            ]
        )
    )
    second.run()
    worker = second.system.train_workers[0]
    assert execute(worker.get_train_step) == 3  # set_train_step(2) on resume, then one step
    assert metric_steps(second.run_dir) == [3]


class LengthScoringProcessor(GRPOProcessor):
    """The "later stage" that scores a `simple` worker's trajectories: reward = length."""

    def _fit(self, batch: Batch, update_fn: str) -> None:
        assert set(batch.values["reward"]) == {None}  # the simple worker left them unscored
        batch.values["reward"] = [float(len(r)) for r in batch.values["response_ids"]]
        super()._fit(batch, update_fn)


@pytest.mark.slow
def test_simple_worker_generates_unscored_groups_a_later_stage_scores(small_overrides):
    controller = NexRLController(
        load_config(
            [
                *small_overrides,
                "rollout_worker.type=simple",
                f"algorithm.type={__name__}:LengthScoringProcessor",
                "train_worker.total_train_steps=2",
            ]
        )
    )
    assert type(controller.system.rollout_workers[0]).__name__ == "SimpleRolloutWorker"
    controller.run()
    assert metric_steps(controller.run_dir) == [1, 2]
    lines = (Path(controller.run_dir) / "metrics.jsonl").read_text().splitlines()
    final = [x for x in map(json.loads, lines) if "val/num_samples" in x][-1]
    assert final["val/unscored"] == final["val/num_samples"] == 8  # none scored, none lost
    assert "val/reward" not in final


# ---- seed: "Validation Usage", the snippet's `step` in a worker class ----
class SeedValidatingWorker(BaseRolloutWorker):  # CHANGED: the snippet is the body of a worker
    def step(self, task: dict[str, Any]) -> str | None:
        # Check if in validation mode
        if self._is_running_validate:
            # Use validation dataloader and validator
            validate_task = self._get_validate_task()
            trajectory = self._process_task(validate_task)
            return self._put_validate_trajectory(trajectory)
        else:
            # Normal training mode
            trajectory = self._process_task(task)
            return self._put_trajectory(trajectory)


class CountingValidatingWorker(SeedValidatingWorker):
    """The seed worker, counting what its validation branch hands to the validator."""

    validated: list[str] = []

    def _put_validate_trajectory(self, trajectory):
        if self.current_task.is_validate:
            type(self).validated.append(self.current_task.uid)
        return super()._put_validate_trajectory(trajectory)


@pytest.mark.slow
def test_validation_usage_snippet_validates_before_and_during_training(small_overrides):
    CountingValidatingWorker.validated = []
    controller = NexRLController(
        load_config(
            [
                *small_overrides,
                f"rollout_worker.type={__name__}:CountingValidatingWorker",
                "validate.validate_before_train=true",
                "weight.validate_freq=2",
            ]
        )
    )
    controller.run()
    assert metric_steps(controller.run_dir) == [1, 2, 3]
    lines = (Path(controller.run_dir) / "metrics.jsonl").read_text().splitlines()
    vals = [x for x in map(json.loads, lines) if "val/num_samples" in x]
    # before training, after step 2 (validate_freq), and the final weights (step 3)
    assert [x["step"] for x in vals] == [0, 2, 3]
    assert all(x["val/num_samples"] == 8 and "val/reward" in x for x in vals)
    validated = CountingValidatingWorker.validated
    assert len(validated) == 3 * 8 and all(uid.startswith("val-") for uid in validated)


def test_put_validate_trajectory_names_n_samples_when_one_of_several_comes(controller):
    worker = controller.system.rollout_workers[0]
    worker._context = dataclasses.replace(worker._context, validate_samples=2)
    worker.current_task = Task(data={"prompt": "abcd", "uid": "val-0-0"}, is_validate=True)
    assert worker._get_validate_task() is worker.current_task
    with pytest.raises(ValueError, match=r"put 1 trajectories but validate.n_samples=2"):
        worker._put_validate_trajectory({"prompt": "abcd", "response": "x"})
    # a training task still running when validation began: its trajectory joins its group
    worker.current_task = Task(data={"prompt": "abcd", "uid": "0-1"})
    worker._per_thread.episodes = collected = []
    assert worker._put_validate_trajectory(traj("0-1")) == "success"
    assert [[t["uid"] for t in e] for e in collected] == [["0-1"]]
    worker.current_task = None
    with pytest.raises(RuntimeError, match="inside step"):
        worker._get_validate_task()
