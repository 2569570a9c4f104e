"""The KL reference defaults to the initial policy: a KL run needs no ref_model_path."""

from __future__ import annotations

import pytest

from nexrl.algorithms.kl import reference_model_path
from nexrl.config import load_config


@pytest.mark.parametrize(
    ("overrides", "want"),
    [
        ([], None),  # no KL: no reference model is loaded
        (["algorithm.kl_in_reward_coef=0.01"], "/m/policy"),
        (["+algorithm.loss_kwargs.kl_coef=0.01"], "/m/policy"),
        (
            ["algorithm.kl_in_reward_coef=0.01", "train_worker.engine.ref_model_path=/m/ref"],
            "/m/ref",
        ),
    ],
)
def test_reference_model_path(overrides, want):
    cfg = load_config(["model_path=/m/policy", *overrides])
    assert reference_model_path(cfg) == want
