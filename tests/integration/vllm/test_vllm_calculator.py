"""The calculator recipe (`smollm2_calculator`) on vLLM: SmolLM2 calls the tool through
the agent workflow, two GRPO steps, with nexrl starting and stopping the vLLM server
(backend vllm, no url). Token-exact: each turn's prompt is the trajectory so far and its
policy tokens are the ids vLLM returned, never a re-tokenization of its text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nexrl import NexRLController
from nexrl.config import load_config
from tests.integration.agents.test_smollm2_calculator import QUESTION, SEEN, _spans

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]  # a start: 30 s-10 min


def run(tmp_path: Path, smollm2_dir: str) -> NexRLController:
    data = tmp_path / "question.jsonl"
    data.write_text(json.dumps(QUESTION) + "\n")
    cfg = load_config(
        [
            f"output_dir={tmp_path}",
            f"data.path={data}",
            f"validate.data.path={data}",
            f"model_path={smollm2_dir}",
            "rollout_worker.workflow=tests.integration.agents.test_smollm2_calculator:"
            "CalculatorRecorder",
            "rollout_worker.workflow_kwargs.max_turns=2",
            "rollout_worker.num_workers=1",
            "rollout_worker.group_size=2",
            "rollout_worker.temperature=0",
            "trajectory_pool.batch_size=2",
            "train_worker.total_train_steps=2",
            "algorithm.loss_kwargs.entropy_coef=0.01",  # a gradient although rewards tie
            "train_worker.engine.lr=1e-7",  # too small to change the greedy episode
            "validate.validate_before_train=false",
            "weight.validate_freq=0",
            "logger.backend=[jsonl]",
            "service.inference_service.backend=vllm",
            "service.inference_service.engine.max_model_len=512",
        ],
        config_name="smollm2_calculator",
    )
    SEEN.clear()
    controller = NexRLController(cfg)
    try:
        controller.run()
    finally:
        from nexrl.inference.vllm_server import shutdown_servers

        shutdown_servers()  # the test session goes on: stop this run's server now
    return controller


def test_calculator_recipe_runs_token_exact_on_vllm(tmp_path, smollm2_dir):
    controller = run(tmp_path, smollm2_dir)
    assert (Path(controller.run_dir) / "vllm-default.log").exists()  # managed, logs in run dir
    lines = (Path(controller.run_dir) / "metrics.jsonl").read_text().splitlines()
    train = [x for x in map(json.loads, lines) if "train/loss" in x]
    assert [x["step"] for x in train] == [1, 2]
    assert all(x["agent/tool_calls"] == 1 and x["agent/parse_failures"] == 0 for x in train)
    assert all(x["agent/turns"] == 2 for x in train)
    assert train[-1]["rollout/serving_version"] >= 1  # the first push reached vLLM
    assert len(SEEN) >= 4
    for seen in SEEN:
        traj, calls = seen["traj"], seen["calls"]
        ids = traj["prompt_ids"] + traj["response_ids"]
        mask = [0] * len(traj["prompt_ids"]) + traj["loss_mask"]
        policy = [(s, e) for s, e, m in _spans(mask) if m]
        assert len(calls) == len(policy) == 2  # the call turn and the answer turn
        for (prompt, out), (s, e) in zip(calls, policy, strict=True):
            assert prompt == ids[:s] and out == ids[s:e]  # vLLM's ids, as sampled
        logprobs = traj["response_logprobs"]
        assert len(logprobs) == len(traj["response_ids"])
        assert all(lp <= 0 for lp, m in zip(logprobs, traj["loss_mask"], strict=True) if m)
