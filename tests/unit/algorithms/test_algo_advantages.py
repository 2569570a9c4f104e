"""Advantage estimators against hand-computed values."""

import math
import statistics

import pytest
import torch

from nexrl.algorithms import ADVANTAGE_ESTIMATORS

# groups: {0: [1, 0, 0, 1]}, {1: [2]} (a singleton), {2: [3, 5]}
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 3.0, 5.0])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 2, 2])


def response_mask(n: int = 7, t: int = 4) -> torch.Tensor:
    """Row i has a 1-token prompt (0) and 1 + i % 3 response tokens."""
    mask = torch.zeros(n, t)
    for i in range(n):
        mask[i, 1 : 2 + i % 3] = 1
    return mask


def per_sample(adv: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """The constant value of each row on its mask (and check it is 0 off the mask)."""
    assert torch.all(adv[mask == 0] == 0)
    out = []
    for row, m in zip(adv, mask, strict=True):
        vals = row[m > 0]
        assert torch.allclose(vals, vals[0].expand_as(vals))
        out.append(float(vals[0]))
    return out


def test_grpo_hand_values():
    mask = response_mask()
    adv = ADVANTAGE_ESTIMATORS.get("grpo")(REWARDS, GROUPS, mask)
    s0 = math.sqrt(4 * 0.25 / 3)  # unbiased std of [1, 0, 0, 1]
    s2 = math.sqrt(2.0)  # unbiased std of [3, 5]
    want = [0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0, 0.0, -1 / s2, 1 / s2]
    assert per_sample(adv, mask) == pytest.approx(want, rel=1e-5)


def test_dr_grpo_has_no_std():
    mask = response_mask()
    adv = ADVANTAGE_ESTIMATORS.get("dr_grpo")(REWARDS, GROUPS, mask)
    assert per_sample(adv, mask) == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.0, -1.0, 1.0])


def test_rloo_leave_one_out():
    mask = response_mask()
    adv = ADVANTAGE_ESTIMATORS.get("rloo")(REWARDS, GROUPS, mask)
    want = [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3, 0.0, 3 - 5, 5 - 3]
    assert per_sample(adv, mask) == pytest.approx(want, rel=1e-6)


def _whiten(values: list[float]) -> list[float]:
    mean, std = statistics.fmean(values), statistics.pstdev(values)
    return [(v - mean) / std for v in values]


def test_reinforce_plus_plus_whitens_over_batch_tokens():
    rewards = torch.tensor([1.0, 0.0, 3.0])
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.float32)
    adv = ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus")(rewards, torch.arange(3), mask)
    tokens = [1.0, 1.0, 0.0, 3.0, 3.0, 3.0]  # the reward on every response token
    assert adv[mask > 0].tolist() == pytest.approx(_whiten(tokens), rel=1e-5)
    assert torch.all(adv[mask == 0] == 0)


def test_reinforce_plus_plus_discounted_token_rewards_skip_tool_tokens():
    mask = torch.tensor([[0, 1, 1, 0, 1]], dtype=torch.float32)  # token 3 is tool output
    token_rewards = torch.tensor([[0.0, 0.0, 0.0, 7.0, 1.0]])  # off-mask reward ignored
    adv = ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus")(
        token_rewards, torch.zeros(1, dtype=torch.long), mask, gamma=0.5
    )
    returns = [0.25, 0.5, 1.0]  # 1 at t=4, discounted once per *policy* token
    assert adv[mask > 0].tolist() == pytest.approx(_whiten(returns), rel=1e-5)


def test_reinforce_plus_plus_baseline():
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0])
    mask = torch.ones(4, 1)
    adv = ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus_baseline")(
        rewards, torch.tensor([0, 0, 1, 1]), mask
    )
    assert adv[:, 0].tolist() == pytest.approx(_whiten([0.5, -0.5, 0.0, 0.0]), rel=1e-5)


def test_unknown_estimator_kwarg_raises_naming_it():
    with pytest.raises(TypeError, match="gamma"):
        ADVANTAGE_ESTIMATORS.get("grpo")(REWARDS, GROUPS, response_mask(), gamma=0.9)


def test_unknown_estimator_name_lists_choices():
    with pytest.raises(KeyError, match="rloo"):
        ADVANTAGE_ESTIMATORS.get("gae")
