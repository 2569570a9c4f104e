"""Faults during a run (docs/reliability.md, "Faults during a run"): a checkpoint
that passes its manifest but does not load, rewards that fail or hang, a stopped
trainer process, a remote server that went away. Real runs on the tiny model."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nexrl.config import load_config
from nexrl.controller import NexRLController, TrainingAborted
from nexrl.inference.client import LLMServiceClient
from nexrl.training.checkpoint import COMPLETE_FILE
from nexrl.training.config import EngineConfig
from nexrl.training.process_engine import ProcessTrainEngine
from nexrl.training.synthetic import random_batch


def _config(tmp_path: Path, model: str, *extra: str):
    return load_config(
        [
            f"output_dir={tmp_path / 'out'}",
            f"model_path={model}",
            "rollout_worker.group_size=4",
            "rollout_worker.max_tokens=4",
            "rollout_worker.num_workers=2",
            "trajectory_pool.batch_size=16",
            "train_worker.total_train_steps=3",
            "train_worker.save_freq=1",
            "weight.validate_freq=0",
            "validate.validate_before_train=false",
            "logger.backend=[jsonl]",
            *extra,
        ]
    )


def _run(cfg) -> NexRLController:
    controller = NexRLController(cfg)
    try:
        controller.run()
    finally:
        controller.shutdown()
    return controller


@pytest.mark.slow
def test_a_checkpoint_that_does_not_load_falls_back_to_the_previous(
    tmp_path, tiny_model_path, caplog
):
    """An older manifest (sizes only) over a trainer_state.pt garbled in place: the
    checkpoint looks complete, fails to load, and resume takes the one before it."""
    first = _run(_config(tmp_path, tiny_model_path))
    ckpts = Path(first.run_dir) / "checkpoints"
    newest = ckpts / "global_step_3"
    state = newest / "trainer_state.pt"
    data = bytearray(state.read_bytes())
    data[:64] = bytes(64)  # the zip header: torch.load cannot parse it
    state.write_bytes(bytes(data))
    manifest = json.loads((newest / COMPLETE_FILE).read_text())
    for entry in manifest["files"].values():
        entry.pop("sha256", None)  # what an older nexrl wrote
    (newest / COMPLETE_FILE).write_text(json.dumps(manifest))
    again = _run(
        _config(tmp_path, tiny_model_path, "resume.mode=auto", "train_worker.total_train_steps=4")
    )
    assert again.run_dir == first.run_dir
    assert f"checkpoint {newest} does not load (checkpoint {newest}: cannot read" in caplog.text
    assert f"using {ckpts / 'global_step_2'}" in caplog.text
    assert (ckpts / "global_step_4").is_dir()


def always_fails(prompt, completion, **row):
    raise RuntimeError("reward backend down")


def fails_on_one_row(prompt, completion, **row):
    if row.get("index") == 0:
        raise RuntimeError("bad row")
    return 1.0


@pytest.mark.slow
def test_a_run_that_only_fails_stops_under_stop_on_critical(tmp_path, tiny_model_path):
    cfg = _config(
        tmp_path,
        tiny_model_path,
        f"rollout_worker.reward_fn={__name__}:always_fails",
        "runtime_monitor.exception_handling.policy=stop_on_critical",
        "runtime_monitor.exception_handling.max_consecutive_errors=8",
    )
    controller = NexRLController(cfg)
    start = time.monotonic()
    try:
        with pytest.raises(TrainingAborted, match="since the last train step.*reward backend"):
            controller.run()
    finally:
        controller.shutdown()
    assert time.monotonic() - start < 60  # before: no step and no stop in 240 s


@pytest.mark.slow
def test_one_failing_sample_does_not_stop_the_default_policy(tmp_path, tiny_model_path):
    cfg = _config(
        tmp_path,
        tiny_model_path,
        f"rollout_worker.reward_fn={__name__}:fails_on_one_row",
        "data.shuffle=false",
    )
    assert cfg.runtime_monitor.exception_handling.policy == "stop_on_error"
    controller = _run(cfg)
    assert (Path(controller.run_dir) / "checkpoints" / "global_step_3").is_dir()
    counters = controller.activity_tracker.get_counters()
    assert counters["tasks_failed/train"] == 1  # counted, not lost, not fatal


HUNG_REWARD = """
import time
from nexrl.rewards.runner import RewardRunner

def hangs(prompt, completion, **row):
    time.sleep(120)
    return 1.0

runner = RewardRunner(hangs, timeout_s=0.5)
outcome = runner.score("p", "c")
print(outcome.error, flush=True)
runner.close()
"""


@pytest.mark.slow
def test_a_hung_reward_in_thread_mode_does_not_block_exit():
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", HUNG_REWARD], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "timeout"
    assert time.monotonic() - start < 30  # before: the exit waited for the 120 s sleep


@pytest.mark.slow
def test_a_stopped_trainer_process_is_reported(tiny_model_path):
    engine = ProcessTrainEngine(EngineConfig(), tiny_model_path, heartbeat_timeout_s=3.0)
    try:
        engine.compute_logprobs(random_batch(2, 8))  # alive and beating
        os.kill(engine.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(
            RuntimeError,
            match=r"no heartbeat for 3 s during 'compute_logp.*"
            r"stopped: SIGSTOP",
        ):
            engine.compute_logprobs(random_batch(2, 8))
        assert time.monotonic() - start < 15  # before: silent for 300 s and more
    finally:
        engine.close()


@pytest.mark.slow
def test_a_remote_server_that_went_away_is_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens
    url = f"http://127.0.0.1:{port}"
    client = LLMServiceClient(
        {"backend": "remote", "url": url, "max_retries": 2, "engine": {}, "model": "m"}
    )
    with pytest.raises(ConnectionError) as err:
        client.completion(prompt_ids=[1, 2, 3], max_tokens=2)
    message = str(err.value)
    assert f"inference server {url} did not answer after 2 tries" in message
    assert "service.inference_service.url" in message and "\n" not in message
    with pytest.raises(ConnectionError, match=f"inference server {url}"):
        client.pause()
