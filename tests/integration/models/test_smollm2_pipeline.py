"""A few real SmolLM2 GRPO steps through the whole pipeline: chat template, engine, train,
weight push, validation; the served weights equal the trained ones after the push."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nexrl import NexRLController
from nexrl.builders import inference_config
from nexrl.config import load_config
from nexrl.inference.client import get_local_engine


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode",
    [[], ["weight.sync_mode=fully-async", "weight.staleness_threshold=1"]],
    ids=["sync", "fully-async"],
)
def test_smollm2_recipe_trains_and_serves_the_trained_weights(smollm2_dir, tmp_path, mode):
    cfg = load_config(
        [
            *mode,
            f"output_dir={tmp_path}",
            f"model_path={smollm2_dir}",
            "rollout_worker.num_workers=1",
            "rollout_worker.group_size=4",
            "rollout_worker.max_tokens=6",
            "trajectory_pool.batch_size=8",
            "train_worker.total_train_steps=2",
            "train_worker.save_freq=2",
            "train_worker.engine.lr=1e-5",
            "algorithm.loss_kwargs.entropy_coef=0.01",  # a gradient even if all rewards tie
            "validate.data.max_items=4",
            "validate.validate_before_train=false",
            "weight.validate_freq=0",
            "logger.backend=[jsonl]",
        ],
        config_name="smollm2_arithmetic",
    )
    controller = NexRLController(cfg)
    engine = get_local_engine(inference_config(controller._config))  # the run's engine
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    controller.run()
    lines = (Path(controller.run_dir) / "metrics.jsonl").read_text().splitlines()
    train = [x for x in map(json.loads, lines) if "train/loss" in x]
    assert [x["step"] for x in train] == [1, 2]
    assert all(x["staleness/max"] <= (1 if mode else 0) for x in train)
    prompt = train[0]["samples"][0]["prompt"] if "samples" in train[0] else None
    assert prompt is None or isinstance(prompt, list)  # chat messages, not text
    trained = load_file(
        str(Path(controller.run_dir) / "checkpoints/global_step_2/model.safetensors")
    )
    served = engine.model.state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(served[name], before[name])  # the push reached the engine
    for key, value in trained.items():
        if key in served:
            assert torch.equal(served[key], value), key
