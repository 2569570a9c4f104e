"""Advantage estimators against hand-computed values."""

import math
import statistics

import numpy as np
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
    """Whitening with the sample (n - 1) standard deviation, as verl's `masked_whiten`."""
    mean, std = statistics.fmean(values), statistics.stdev(values)
    return [(v - mean) / std for v in values]


def test_whitening_hand_values_use_unbiased_variance():
    # tokens [1, 1, 3, 3]: mean 2, squared deviations sum 4, unbiased var 4 / 3
    rewards = torch.tensor([1.0, 3.0])
    mask = torch.ones(2, 2)
    adv = ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus")(rewards, torch.arange(2), mask, eps=0.0)
    # returns-to-go with the reward on the last token: row 0 is [1, 1], row 1 is [3, 3]
    assert adv.flatten().tolist() == pytest.approx([-math.sqrt(3 / 4)] * 2 + [math.sqrt(3 / 4)] * 2)


def test_reinforce_plus_plus_matches_independent_whitening_on_12x7_batch():
    gen = torch.Generator().manual_seed(0)
    token_rewards = torch.randn(12, 7, generator=gen, dtype=torch.float64)
    mask = (torch.rand(12, 7, generator=gen) > 0.3).to(torch.float64)
    mask[:, 0] = 1  # every row has a response token
    adv = ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus")(token_rewards, torch.arange(12), mask)
    # independent: per-row reverse cumsum over masked tokens, then numpy ddof=1 whitening
    rows = []
    for r, m in zip(token_rewards.numpy(), mask.numpy(), strict=True):
        kept = r[m > 0]
        rows.append(np.cumsum(kept[::-1])[::-1])
    flat = np.concatenate(rows)
    want = (flat - flat.mean()) / np.sqrt(flat.var(ddof=1) + 1e-8)
    got = adv[mask > 0].numpy()
    assert np.abs(got - want).max() < 1e-12
    biased = (flat - flat.mean()) / np.sqrt(flat.var(ddof=0) + 1e-8)
    assert np.abs(got - biased).max() > 1e-3  # the (n) variance would fail this test
    assert torch.all(adv[mask == 0] == 0)


def test_whitening_needs_two_tokens():
    with pytest.raises(ValueError, match="at least 2 response tokens"):
        ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus")(
            torch.tensor([1.0]), torch.arange(1), torch.tensor([[0.0, 1.0]])
        )


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


# one group of 3 episodes: episode 0 made two samples (reward 1), episodes 1 and 2 one each (0)
EP_REWARDS = torch.tensor([1.0, 1.0, 0.0, 0.0])
EP_GROUPS = torch.tensor([0, 0, 0, 0])
EPISODES = torch.tensor([0, 0, 1, 2])


def test_group_stats_count_each_episode_once():
    from nexrl.algorithms import group_stats

    mean, std, size = group_stats(EP_REWARDS, EP_GROUPS, EPISODES)
    assert torch.allclose(mean, torch.full((4,), 1 / 3))  # mean of [1, 0, 0], not of 4 samples
    assert torch.allclose(std, torch.full((4,), math.sqrt((4 / 9 + 2 / 9) / 2)))
    assert size.tolist() == [3, 3, 3, 3]
    with pytest.raises(ValueError, match=r"episode_index \(3,\) must be \(N,\)"):
        group_stats(EP_REWARDS, EP_GROUPS, EPISODES[:3])


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # episodes [1, 0, 0]: mean 1/3, unbiased std sqrt(1/3)
        ("grpo", [(2 / 3) / math.sqrt(1 / 3)] * 2 + [(-1 / 3) / math.sqrt(1 / 3)] * 2),
        ("dr_grpo", [2 / 3, 2 / 3, -1 / 3, -1 / 3]),
        ("rloo", [1.0, 1.0, -0.5, -0.5]),  # minus the mean of the other episodes
    ],
)
def test_every_sample_of_an_episode_gets_the_episode_advantage(name, expected):
    mask = torch.ones(4, 2)
    adv = ADVANTAGE_ESTIMATORS.get(name)(EP_REWARDS, EP_GROUPS, mask, episode_index=EPISODES)
    assert per_sample(adv, mask) == pytest.approx(expected, abs=1e-5)
    # without it the two-sample episode counts twice: mean 1/2, not 1/3
    plain = ADVANTAGE_ESTIMATORS.get(name)(EP_REWARDS, EP_GROUPS, mask)
    assert per_sample(plain, mask)[0] != pytest.approx(expected[0], abs=1e-3)


def test_reinforce_plus_plus_baseline_counts_each_episode_once():
    mask = torch.ones(4, 1)
    fn = ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus_baseline")
    adv = fn(EP_REWARDS, EP_GROUPS, mask, episode_index=EPISODES)
    returns = torch.tensor([2 / 3, 2 / 3, -1 / 3, -1 / 3])  # reward - baseline 1/3
    whitened = (returns - returns.mean()) / math.sqrt(returns.var().item() + 1e-8)
    assert per_sample(adv, mask) == pytest.approx(whitened.tolist(), abs=1e-5)
