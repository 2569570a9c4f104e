"""The controller end to end in local mode, on the tiny model, a few steps."""

import json
from pathlib import Path

import pytest

from nexrl.controller import NexRLController, TrainingAborted


def read_metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_run_writes_metrics_config_and_checkpoints(small_config):
    controller = NexRLController(small_config())
    final = controller.run()
    run = Path(controller.run_dir)
    lines = read_metrics(run)
    assert all("step" in line for line in lines)
    train_steps = [line["step"] for line in lines if "train/loss" in line]
    assert train_steps == [1, 2, 3]
    val_steps = [line["step"] for line in lines if "val/reward" in line]
    assert val_steps == [0, 2, 3]  # before training, every 2 syncs, and at the end
    assert 0.0 <= final["val/reward"] <= 1.0
    assert (run / "config.yaml").exists()
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["global_step_2", "global_step_3"]  # the newest and the fallback
    assert (run / "checkpoints" / "global_step_3" / "model.safetensors").exists()
    step_line = next(line for line in lines if line.get("step") == 2 and "train/loss" in line)
    assert step_line["staleness/max"] == 0  # sync mode trains on-policy only
    assert step_line["rollout/serving_version"] == 1
    assert step_line["train/behavior_old_logprob_absdiff"] < 1e-4
    check_phase_timings(lines)


def check_phase_timings(lines):
    """Each step's time is split into its phases: waiting for the batch, the update,
    the checkpoint when one is saved, the weight export and the previous step's push."""
    steps = {line["step"]: line for line in lines if "train/loss" in line}
    for step, line in steps.items():
        assert {"timing/wait_s", "timing/update_s", "timing/export_s"} <= line.keys()
        assert ("timing/push_s" in line) == (step > 1)  # a push is logged with the next step
        assert ("timing/save_s" in line) == (step in (2, 3))  # save_freq 2, and the last step
        assert "timing/old_s" not in line  # on-policy: the update's forward made them
        parts = sum(
            v
            for k, v in line.items()
            if k.startswith("timing/") and k not in ("timing/step_s", "timing/train_s")
        )
        assert parts <= line["timing/step_s"] + 1e-6
        assert line["timing/update_s"] <= line["timing/train_s"]


def test_resume_auto_continues_from_the_newest_checkpoint(small_config, tmp_path):
    first = NexRLController(small_config())
    first.run()
    again = NexRLController(
        small_config(
            "resume.mode=auto",
            "train_worker.total_train_steps=5",
            "validate.validate_before_train=false",
        )
    )
    again.run()
    assert again.run_dir == first.run_dir  # the same run folder continues
    steps = [line["step"] for line in read_metrics(again.run_dir) if "train/loss" in line]
    assert steps == [1, 2, 3, 4, 5]  # the first run's 1-3, then 4 and 5 appended
    assert (Path(again.run_dir) / "checkpoints" / "global_step_5").exists()


def failing_reward(prompt, completion, **row):
    raise RuntimeError("reward server unreachable")


def test_raising_reward_stops_the_run_under_stop_on_error(small_config):
    cfg = small_config(
        "rollout_worker.reward_fn=tests.integration.core.test_controller:failing_reward"
    )
    controller = NexRLController(cfg)
    with pytest.raises(TrainingAborted, match="reward server unreachable"):
        controller.run()
    health = controller.activity_tracker.get_error_health_status()
    assert health["error_level_count"] >= 1


def test_raising_reward_is_counted_not_lost_under_continue(small_config):
    cfg = small_config(
        "rollout_worker.reward_fn=tests.integration.core.test_controller:failing_reward",
        "runtime_monitor.exception_handling.policy=continue",
        "validate.validate_before_train=true",
        "train_worker.total_train_steps=1",
        "data.num_epochs=1",
        "data.max_items=3",
        "rollout_worker.max_task_retries=1",
    )
    controller = NexRLController(cfg)
    controller.run()
    counters = controller.activity_tracker.get_counters()
    assert counters["tasks_failed/train"] == 3  # every task tried twice, then counted
    assert counters["tasks_failed/validate"] == 8
    errors = controller.activity_tracker.error_reporter.get_errors()
    assert len(errors) == 3 * 2 + 8 * 2
    assert all("reward server unreachable" in e.message for e in errors)


def test_validation_with_several_samples_logs_pass_at_k(small_config):
    cfg = small_config(
        "train_worker.total_train_steps=1",
        "validate.n_samples=2",
        "validate.temperature=1.0",
        "validate.validate_before_train=false",
    )
    controller = NexRLController(cfg)
    metrics = controller.run()
    assert {"val/pass@1", "val/pass@2"} <= set(metrics)
    assert 0.0 <= metrics["val/pass@1"] <= metrics["val/pass@2"] <= 1.0
    assert metrics["val/num_samples"] == 2 * 8  # validate.data.max_items=8, two samples each
    assert 0 < metrics["val/time_s"] < 120


def test_engine_options_from_the_config_reach_the_built_in_engine(small_config):
    """`service.inference_service.engine.*` builds the run's engine: a bf16 engine on the
    torch matmul and attention paths, on two torch threads of its own (the tiny model
    would get one), samples a fp32-trained policy, and its logprobs stay within bf16
    rounding of the trainer's (the gap the IS correction is for)."""
    import torch
    import torch.nn.functional as F

    from nexrl.inference import client

    controller = NexRLController(
        small_config(
            "+service.inference_service.engine.dtype=bfloat16",
            "+service.inference_service.engine.matmul=torch",
            "+service.inference_service.engine.native_attention=false",
            "+service.inference_service.engine.max_prefill_tokens=256",
            "+service.inference_service.engine.threads=2",
            "train_worker.engine.threads=2",  # the trainer likewise
        )
    )
    (engine,) = client._local_engines.values()
    runner = engine.runner
    assert runner.dtype == torch.bfloat16
    assert runner.native_attention is None and runner.fused is None and runner.linear is F.linear
    assert engine.max_prefill_tokens == 256
    assert engine._command(torch.get_num_threads) == 2
    controller.run()
    lines = read_metrics(controller.run_dir)
    step2 = next(line for line in lines if line.get("step") == 2 and "train/loss" in line)
    assert step2["rollout/serving_version"] == 1
    assert 1e-5 < step2["train/behavior_old_logprob_absdiff"] < 0.05


def test_a_restart_after_the_last_step_rewinds_then_validates_the_final_weights(small_config):
    """An actor restart between the last step and the final validation rewinds the run
    (here the rewind itself is stood in for: local mode has no actors to restart), which
    then ends and validates; it used to escape `run`."""
    from nexrl.distributed.recovery import ActorRestartedError

    cfg = small_config("train_worker.total_train_steps=2", "validate.validate_before_train=false")
    controller = NexRLController(cfg)
    validate, rewinds = controller._run_validate, []

    def restarted_once(tag):
        if not rewinds:
            raise ActorRestartedError("train_worker_0.get_train_step: Ray actor 'train' restarted")
        validate(tag)

    controller._run_validate = restarted_once
    # a rewind only after the error (the watch loop's periodic check finds no restart)
    controller._rewind_after_restart = lambda settle=False: settle and not rewinds.append(settle)
    metrics = controller.run()
    assert rewinds == [True] and "val/reward" in metrics
