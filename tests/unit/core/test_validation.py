"""Validator metrics: per-source means and the unbiased pass@k."""

import math

import pytest

from nexrl.config.schema import ValidateConfig
from nexrl.validation import Validator, ks_up_to, pass_at_k


def traj(uid, reward, source=None):
    t = {"uid": uid, "reward": reward, "response_ids": [1, 2]}
    return {**t, "source": source} if source else t


def test_pass_at_k_matches_the_combinatorial_definition():
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))  # 0.5
    assert ks_up_to(4) == [1, 2, 4] and ks_up_to(6) == [1, 2, 4, 6] and ks_up_to(1) == [1]


def test_metrics_per_source_and_pass_at_k():
    v = Validator(ValidateConfig(n_samples=2))
    v.begin(expected=2)
    for t in [traj("a", 1.0, "gsm8k"), traj("a", 0.0, "gsm8k"), traj("b", 0.0, "math")]:
        v.put_trajectory(t)
    assert not v.is_complete()  # b still owes a sample
    v.put_trajectory(traj("b", 0.0, "math"))
    assert v.is_complete()
    m = v.compute_metrics()
    assert m["val/gsm8k/reward"] == 0.5 and m["val/math/reward"] == 0.0
    assert m["val/pass@1"] == pytest.approx(0.25)  # task a: 1/2, task b: 0
    assert m["val/pass@2"] == pytest.approx(0.5)  # task a: certain, task b: 0
    assert m["val/reward"] == 0.25
