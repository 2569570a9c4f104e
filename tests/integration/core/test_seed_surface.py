"""Seed 000's own snippets, as a user would write them, train end to end."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import nexrl
from nexrl import NexRLController, TrainingAborted

SEED_NAMES = [
    "NexRLController",
    "BaseRolloutWorker",
    "SimpleRolloutWorker",
    "BaseAlgorithmProcessor",
    "TrajectoryPool",
    "TrainBatchPool",
    "BaseDataLoader",
    "LLMServiceClient",
    "TrainServiceClient",
    "WeightSyncController",
    "Validator",
    "TrainWorker",
    "ActivityTracker",
    "ActivityTrackerProxy",
    "ErrorReporter",
    "ErrorSeverity",
    "Batch",
    "NexRLRole",
    "NexRLModule",
    "execute",
    "execute_async",
]

# The seed's "Custom RolloutWorker Implementation", unchanged but for the import of Any.
SEED_WORKER = """
from nexrl import BaseRolloutWorker
from typing import Any

class MyRolloutWorker(BaseRolloutWorker):
    def step(self, task: dict[str, Any]) -> str | None:
        if "prompt" not in task:
            return None
        prompt = task["prompt"]
        result = self._llm_client.completion(prompt, temperature=0.7)
        trajectory = {
            "prompt": prompt,
            "response": result["response"],
            "finish_reason": result["finish_reason"],
            "custom_metadata": task.get("metadata", {}),
            "model_tag": self._llm_client._model_tag
        }
        return self._put_trajectory(trajectory)

class BrokenWorker(BaseRolloutWorker):
    def step(self, task):
        return self._put_trajectory({"prompt": task["prompt"], "response": "never generated"})
"""

# The seed's "Custom AlgorithmProcessor Implementation" shape: `_fit` builds the
# train batch and hands it on with `_put_batch`.
SEED_PROCESSOR = """
import torch
from nexrl import BaseAlgorithmProcessor, Batch, collate

class MyAlgorithmProcessor(BaseAlgorithmProcessor):
    def _fit(self, batch: Batch, update_fn: str):
        trajectories = batch.to_trajectories()
        processed_values = self._process_values(trajectories)
        processed_batch = Batch(values=processed_values, metadata=batch.metadata)
        self._put_batch(processed_batch, update_fn)

    def _process_values(self, trajectories):
        values = collate(trajectories, self.pad_token_id)
        rewards = torch.tensor([float(t["reward"]) for t in trajectories])
        advantage = (rewards - rewards.mean()).unsqueeze(1)  # a plain baseline
        values["advantages"] = advantage * values["loss_mask"]
        return values
"""


def test_the_seed_names_are_exported():
    missing = [n for n in SEED_NAMES if not hasattr(nexrl, n)]
    assert missing == []


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_nexrl_parts.py").write_text(SEED_WORKER + SEED_PROCESSOR)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_nexrl_parts", None)
    return "my_nexrl_parts"


def train_lines(run_dir) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [x for x in map(json.loads, lines) if "train/loss" in x]


@pytest.mark.slow
def test_a_worker_written_as_in_the_seed_trains(small_config, user_module):
    cfg = small_config(
        f"rollout_worker.type={user_module}:MyRolloutWorker",
        "rollout_worker.group_size=1",
        "trajectory_pool.batch_size=4",
        "algorithm.advantage_estimator=reinforce_plus_plus",
    )
    controller = NexRLController(cfg)
    controller.run()
    lines = train_lines(controller.run_dir)
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert all(x["train/num_tokens"] > 0 for x in lines if "train/num_tokens" in x)


@pytest.mark.slow
def test_a_processor_written_as_in_the_seed_trains(small_config, user_module):
    controller = NexRLController(small_config(f"algorithm.type={user_module}:MyAlgorithmProcessor"))
    controller.run()
    assert [x["step"] for x in train_lines(controller.run_dir)] == [1, 2, 3]


@pytest.mark.slow
def test_a_malformed_trajectory_stops_the_run_naming_the_missing_keys(small_config, user_module):
    cfg = small_config(
        f"rollout_worker.type={user_module}:BrokenWorker",
        "rollout_worker.group_size=1",
        "trajectory_pool.batch_size=4",
        "validate.validate_before_train=false",
    )
    controller = NexRLController(cfg)
    with pytest.raises(TrainingAborted, match=r"missing \['prompt_ids', 'response_ids'"):
        controller.run()


HYDRA_MAIN = """
import hydra
from omegaconf import DictConfig
from nexrl import NexRLController

@hydra.main(config_path="pkg://nexrl.config", config_name="rl_train", version_base=None)
def main(config: DictConfig):
    config.launch_mode = "local"
    print("group_size", config.rollout_worker.group_size, type(NexRLController).__name__)

main()
"""


def test_hydra_main_with_the_packaged_config(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(HYDRA_MAIN))
    out = subprocess.run(
        [sys.executable, str(script), "rollout_worker.group_size=8", "hydra.run.dir=."],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "group_size 8 type" in out.stdout
