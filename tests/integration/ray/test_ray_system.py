"""The controller end to end with `launch_mode=ray` on a local 2-CPU Ray instance."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict

from nexrl.config import load_config
from nexrl.controller import NexRLController, TrainingAborted
from nexrl.execute import ModuleDiedError, execute

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture
def ray_config(tmp_path, tiny_model_path):
    """A few-step Ray run on the built-in task; `ray` = the `ray.*` section to set."""

    def make(*extra: str, ray: dict | None = None):
        cfg = load_config(
            [
                f"output_dir={tmp_path / 'out'}",
                f"model_path={tiny_model_path}",
                "launch_mode=ray",
                "rollout_worker.group_size=4",
                "rollout_worker.max_tokens=4",
                "rollout_worker.num_workers=2",
                "trajectory_pool.batch_size=16",
                "train_worker.total_train_steps=3",
                "train_worker.save_freq=2",
                "weight.validate_freq=2",
                "validate.data.max_items=8",
                "logger.backend=[jsonl]",
                *extra,
            ]
        )
        if ray:
            with open_dict(cfg):
                cfg.ray = OmegaConf.merge(cfg.ray, ray)
        return cfg

    return make


def read_metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def kill_when(controller: NexRLController, group: str, step: int, no_restart: bool) -> None:
    """In the background: once training reaches `step`, kill the actor of `group`."""
    import ray

    def watch() -> None:
        system = controller.system
        while execute(system.train_workers[0].get_train_step) < step:
            time.sleep(0.05)
        ray.kill(system.resource_manager.actors[group], no_restart=no_restart)

    threading.Thread(target=watch, daemon=True).start()


def test_ray_run_keeps_the_local_mode_contract(ray_local, ray_config):
    controller = NexRLController(ray_config(ray={"torch_threads": 2}))
    try:
        actors = controller.system.resource_manager.actors.values()
        assert [execute(a.torch_threads) for a in actors] == [2] * len(actors)
        final = controller.run()
    finally:
        controller.system.shutdown()
    run = Path(controller.run_dir)
    lines = read_metrics(run)
    assert [line["step"] for line in lines if "train/loss" in line] == [1, 2, 3]
    assert [line["step"] for line in lines if "val/reward" in line] == [0, 2, 3]
    assert 0.0 <= final["val/reward"] <= 1.0
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["global_step_2", "global_step_3"]  # the newest and the fallback
    step2 = next(line for line in lines if line.get("step") == 2 and "train/loss" in line)
    assert step2["staleness/max"] == 0
    assert step2["rollout/serving_version"] == 1  # the shared engine got the pushed weights
    assert step2["train/behavior_old_logprob_absdiff"] < 1e-4
    # weight.transport auto: the weights travelled inside the push call, no files
    assert not list((run / "sync_weights").glob("*.safetensors"))


def test_a_run_ends_with_its_data_with_every_task_trained_and_counted(ray_local, ray_config):
    """No step limit: the run ends when the data does (loader finished, every queued
    tracker call flushed, nothing in flight, pools empty)."""
    cfg = ray_config(
        "train_worker.total_train_steps=0",
        "train_worker.save_freq=0",
        "data.num_epochs=1",
        "data.max_items=16",  # 4 tasks per batch: 4 steps
        "weight.validate_freq=0",
        "validate.validate_before_train=false",
    )
    controller = NexRLController(cfg)
    try:
        controller.run()
        counters = execute(controller.activity_tracker.get_counters)
        quiet = execute(controller.activity_tracker.is_quiescent)
    finally:
        controller.system.shutdown()
    lines = read_metrics(controller.run_dir)
    assert [line["step"] for line in lines if "train/loss" in line] == [1, 2, 3, 4]
    assert counters["tasks_trained"] == 16 and quiet


def test_a_dead_actor_stops_the_run_with_a_clear_error(ray_local, ray_config):
    cfg = ray_config(
        "train_worker.total_train_steps=50",
        "runtime_monitor.health_check.check_interval=1.0",
        "validate.validate_before_train=false",
        ray={"layout": "rollout_train"},  # the train actor lives on to see the death
    )
    controller = NexRLController(cfg)
    kill_when(controller, "rollout", step=1, no_restart=True)
    t0 = time.monotonic()
    try:
        # the liveness check (TrainingAborted) or the controller's next call to the dead
        # actor (ModuleDiedError naming the method) - whichever comes first
        with pytest.raises((TrainingAborted, ModuleDiedError), match="died|data_loader"):
            controller.run()
        assert not execute(controller.activity_tracker.check_module_liveness, 5.0)
        dead = execute(controller.activity_tracker.get_dead_modules)
    finally:
        controller.system.shutdown()
    assert {"data_loader", "trajectory_pool", "validator"} <= set(dead)
    assert time.monotonic() - t0 < 120


def test_a_restarted_actor_without_a_checkpoint_stops_the_run_naming_it(ray_local, ray_config):
    """A restart loses the actor's state; with no checkpoint to rewind to (periodic saves
    are off, and the run is far from its last step, which would save) the run stops and
    says which actor and why (a rewind: test_actor_restart). With a checkpoint at step 2
    a fast run may save it between the kill and the moment the restart is noticed, and
    then rightly rewinds to it."""
    cfg = ray_config(
        "train_worker.total_train_steps=50",
        "train_worker.save_freq=0",
        "weight.validate_freq=0",
        "validate.validate_before_train=false",
        ray={"layout": "rollout_train", "groups": {"rollout": {"max_restarts": 1}}},
    )
    controller = NexRLController(cfg)
    kill_when(controller, "rollout", step=1, no_restart=False)
    try:
        with pytest.raises(TrainingAborted, match="rollout .*weight_sync_controller_0.*checkpoint"):
            controller.run()
    finally:
        controller.system.shutdown()


def test_data_parallel_ranks_and_inference_replicas_on_their_own_bundles(ray_local, ray_config):
    cfg = ray_config(
        ray={
            "train_ranks": {"bundles_per_node": [2], "num_cpus_per_bundle": 0.5},
            "inference_replicas": {"bundles_per_node": [2], "num_cpus_per_bundle": 0.5},
        }
    )
    controller = NexRLController(cfg)
    try:
        controller.run()
        replicas = controller.system.replicas
        versions = [execute(r.version) for r in replicas]
        served = [execute(r.served) for r in replicas]
    finally:
        controller.system.shutdown()
    lines = read_metrics(controller.run_dir)
    assert [line["step"] for line in lines if "train/loss" in line] == [1, 2, 3]
    assert versions == [3, 3]  # every replica got every push
    assert min(served) > 0  # both replicas served rollouts
    step2 = next(line for line in lines if line.get("step") == 2 and "train/loss" in line)
    assert step2["rollout/serving_version"] == 1
    # 2 train ranks recompute the logprobs the replicas sampled with: same weights
    assert step2["train/behavior_old_logprob_absdiff"] < 1e-4
    # replicas hold their own engines: weight.transport auto falls back to files
    assert list((Path(controller.run_dir) / "sync_weights").glob("*.safetensors"))


def test_the_controller_runs_as_a_ray_actor(ray_local, ray_config):
    import ray

    cfg = ray_config("train_worker.total_train_steps=2", "weight.validate_freq=0")
    controller = ray.remote(NexRLController).options(num_cpus=0).remote(cfg)  # seed 000 usage
    final = ray.get(controller.run.remote(), timeout=300)
    run_dir = ray.get(controller.__ray_call__.remote(lambda self: self.run_dir))
    ray.get(controller.__ray_call__.remote(lambda self: self.system.shutdown()))
    ray.kill(controller)
    assert 0.0 <= final["val/reward"] <= 1.0
    assert [line["step"] for line in read_metrics(run_dir) if "train/loss" in line] == [1, 2]


def test_the_agent_worker_trains_and_validates_in_ray_actors(ray_local, ray_config):
    """`rollout_worker.type=agent` in Ray mode: each worker's episodes on the event loop of
    its actor, its validation tasks side by side (8 tasks, 2 workers)."""
    workflow = "tests.integration.agents.workflows:TwoTurnWorkflow"
    cfg = ray_config("rollout_worker.type=agent", f"rollout_worker.workflow={workflow}")
    controller = NexRLController(cfg)
    try:
        final = controller.run()
    finally:
        controller.system.shutdown()
    lines = read_metrics(controller.run_dir)
    assert [line["step"] for line in lines if "train/loss" in line] == [1, 2, 3]
    assert [line["step"] for line in lines if "val/reward" in line] == [0, 2, 3]
    assert 0.0 <= final["val/reward"] <= 1.0
    assert [line["val/num_samples"] for line in lines if "val/reward" in line] == [8.0] * 3
