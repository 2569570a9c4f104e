"""KL estimators, the KL reward penalty and the DAPO helpers against hand values."""

import math

import pytest
import torch

from nexrl.algorithms import (
    KL_ESTIMATORS,
    apply_kl_penalty,
    filter_informative,
    informative_groups,
    kl_per_token,
    mask_truncated,
    overlong_penalty,
)

# log r = ref - logp = -0.5 and +1.0
LOGP = torch.tensor([[-1.0, -2.0]])
REF = torch.tensor([[-1.5, -1.0]])


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("k1", [0.5, -1.0]),
        ("k2", [0.125, 0.5]),
        ("k3", [math.exp(-0.5) - 1 + 0.5, math.e - 1 - 1]),
    ],
)
def test_kl_estimators(name, want):
    assert KL_ESTIMATORS.get(name)(LOGP, REF)[0].tolist() == pytest.approx(want, rel=1e-6)


def test_k3_is_zero_and_its_gradient_zero_on_policy():
    logp = torch.tensor([[-0.7, -2.0]], requires_grad=True)
    kl = kl_per_token(logp, logp.detach().clone(), torch.ones(1, 2), "k3")
    kl.sum().backward()
    assert torch.equal(kl, torch.zeros(1, 2))
    assert torch.equal(logp.grad, torch.zeros(1, 2))


def test_kl_per_token_zero_off_mask_even_with_inf_padding():
    logp = torch.tensor([[-1.0, -float("inf")]], requires_grad=True)
    kl = kl_per_token(logp, torch.tensor([[-1.5, 0.0]]), torch.tensor([[1.0, 0.0]]), "k3")
    kl.sum().backward()
    assert kl[0, 1] == 0 and torch.isfinite(logp.grad).all()


def test_kl_penalty_on_scalar_and_token_rewards():
    mask = torch.ones(1, 2)
    scalar, metrics = apply_kl_penalty(torch.tensor([1.0]), LOGP, REF, mask, beta=0.1)
    assert scalar.tolist() == pytest.approx([1.0 - 0.1 * (0.5 - 1.0)])
    assert float(metrics["kl_penalty_seq_mean"]) == pytest.approx(-0.5)
    tokens, _ = apply_kl_penalty(torch.tensor([[0.0, 1.0]]), LOGP, REF, mask, beta=0.1)
    assert tokens[0].tolist() == pytest.approx([-0.05, 1.1])
    with pytest.raises(ValueError, match="rewards"):
        apply_kl_penalty(torch.zeros(1, 3), LOGP, REF, mask, beta=0.1)


def test_informative_groups_drops_constant_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    groups = torch.tensor([7, 7, 3, 3, 9, 9, 4])  # 7 all equal, 3 mixed, 9 all equal, 4 single
    keep = informative_groups(rewards, groups)
    assert keep.tolist() == [False, False, True, True, False, False, False]
    close = informative_groups(torch.tensor([1.0, 1.05]), torch.tensor([0, 0]), atol=0.1)
    assert close.tolist() == [False, False]


def test_filter_informative_on_trajectories():
    trajs = [
        {"uid": "a", "reward": 1},
        {"uid": "b", "reward": 0},
        {"uid": "a", "reward": 1},
        {"uid": "b", "reward": 1},
    ]
    assert filter_informative(trajs) == [trajs[1], trajs[3]]
    with pytest.raises(KeyError, match="trajectory 0 has no 'reward'"):
        filter_informative([{"uid": "a"}])


def test_overlong_penalty_ramp():
    lengths = torch.tensor([10, 16, 18, 20, 25])
    # max 20, buffer 4: free up to 16, linear to -1 at 20, -1 beyond
    got = overlong_penalty(lengths, max_length=20, buffer_len=4, penalty_factor=1.0)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
    half = overlong_penalty(lengths, max_length=20, buffer_len=4, penalty_factor=0.5)
    assert half.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -0.5])
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, max_length=20, buffer_len=0)


def test_mask_truncated_zeroes_length_rows_only():
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    got = mask_truncated(mask, ["stop", "length", None])
    assert got.tolist() == [[0, 1, 1], [0, 0, 0], [1, 1, 1]]
    assert mask[1, 1] == 1  # the input is not modified
    with pytest.raises(ValueError, match="finish_reasons"):
        mask_truncated(mask, ["stop"])
