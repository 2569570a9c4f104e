from __future__ import annotations

import pytest

from nexrl.config import load_config


@pytest.fixture
def small_overrides(tmp_path, tiny_model_path):
    """A few-second local run on the built-in task."""
    return [
        f"output_dir={tmp_path / 'out'}",
        f"model_path={tiny_model_path}",
        "rollout_worker.group_size=4",
        "rollout_worker.max_tokens=4",
        "rollout_worker.num_workers=2",
        "trajectory_pool.batch_size=16",
        "train_worker.total_train_steps=3",
        "train_worker.save_freq=2",
        "weight.validate_freq=2",
        "validate.data.max_items=8",
        "logger.backend=[jsonl]",
    ]


@pytest.fixture
def small_config(small_overrides):
    def make(*extra: str):
        return load_config([*small_overrides, *extra])

    return make
