"""Off-policy correction defaults of the async modes, and the per-batch async metrics."""

import pytest

from nexrl.algorithms.processor import async_metrics
from nexrl.config.schema import AlgorithmConfig
from nexrl.training.train_worker import LossSpec
from nexrl.types import Batch


def kwargs_of(loss_kwargs, mode):
    spec = LossSpec.from_config(AlgorithmConfig(loss_kwargs=loss_kwargs), mode)
    return {k: v for k, v in spec.loss_kwargs.items() if k != "agg_mode"}


def test_sync_keeps_plain_grpo():
    assert kwargs_of({"clip_low": 0.2}, "sync") == {"clip_low": 0.2}


@pytest.mark.parametrize("mode", ["batch-async", "fully-async"])
def test_async_modes_add_token_level_truncated_is(mode):
    out = kwargs_of({"clip_low": 0.2}, mode)
    assert out == {"clip_low": 0.2, "tis_level": "token", "tis_cap": 2.0}


def test_a_users_choice_of_correction_is_kept():
    assert kwargs_of({"decoupled": True}, "fully-async") == {"decoupled": True}


def test_async_metrics_count_per_group_aborts_and_per_sample_continuations():
    trajs = [
        {"uid": "a", "rollout_aborts": 2, "continuations": 1, "token_versions": [0, 1]},
        {"uid": "a", "rollout_aborts": 2, "continuations": 0, "token_versions": [0, 0]},
        {"uid": "b", "rollout_aborts": 0, "continuations": 0, "token_versions": [1]},
        {"uid": "b", "rollout_aborts": 0, "continuations": 0, "token_versions": []},
    ]
    m = async_metrics(Batch.from_trajectories(trajs).values, {"staleness_dropped": 3})
    assert m == {
        "staleness/dropped": 3.0,
        "rollout/aborts": 2.0,
        "rollout/partial_continuations": 1.0,
        "rollout/multi_version_frac": 0.25,
    }
