"""Every registered algorithm option trains in a real run, so an unwired one fails CI.

Five short runs cover each advantage estimator, each policy loss, each aggregation
mode and each KL estimator (in the reward penalty and as a loss term) at least once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nexrl import NexRLController
from nexrl.algorithms.advantages import ADVANTAGE_ESTIMATORS
from nexrl.algorithms.aggregation import AGGREGATIONS
from nexrl.algorithms.kl import KL_ESTIMATORS
from nexrl.algorithms.losses import POLICY_LOSSES

ESTIMATORS = ADVANTAGE_ESTIMATORS.names()
LOSSES = POLICY_LOSSES.names()
AGGS = AGGREGATIONS.names()
KLS = KL_ESTIMATORS.names()
RUNS = max(len(ESTIMATORS), len(LOSSES), len(AGGS), len(KLS))


def test_the_runs_cover_every_registered_option():
    covered = [(ESTIMATORS[i % len(ESTIMATORS)], LOSSES[i % len(LOSSES)]) for i in range(RUNS)]
    assert {e for e, _ in covered} == set(ESTIMATORS) and {x for _, x in covered} == set(LOSSES)


@pytest.mark.slow
@pytest.mark.parametrize("i", range(RUNS))
def test_option_set_trains(small_config, tiny_model_path, i):
    kl = KLS[i % len(KLS)]
    cfg = small_config(
        "train_worker.total_train_steps=2",
        "validate.validate_before_train=false",
        f"algorithm.advantage_estimator={ESTIMATORS[i % len(ESTIMATORS)]}",
        f"algorithm.loss_fn={LOSSES[i % len(LOSSES)]}",
        f"algorithm.loss_agg_mode={AGGS[i % len(AGGS)]}",
        "algorithm.kl_in_reward_coef=0.05",
        f"algorithm.kl_in_reward_estimator={kl}",
        "+algorithm.loss_kwargs.kl_coef=0.01",
        f"+algorithm.loss_kwargs.kl_estimator={KLS[(i + 1) % len(KLS)]}",
        # odd runs name the reference; even runs get the default, the initial policy
        *([f"train_worker.engine.ref_model_path={tiny_model_path}"] if i % 2 else []),
    )
    controller = NexRLController(cfg)
    controller.run()
    lines = (Path(controller.run_dir) / "metrics.jsonl").read_text().splitlines()
    train = [x for x in map(json.loads, lines) if "train/loss" in x]
    assert [x["step"] for x in train] == [1, 2]
    reward_kl = [k for k in train[0] if "kl" in k and not k.startswith("train/")]
    loss_kl = [k for k in train[0] if "kl" in k and k.startswith("train/")]
    assert reward_kl and loss_kl, sorted(train[0])  # both KL placements ran
