"""Truncated IS and decoupled-PPO behaviour weights against hand values."""

import math

import pytest
import torch

from nexrl.algorithms import compute_loss, decoupled_weights, is_weights


def batch_with_log_w(log_w, mask):
    old = torch.full((len(log_w), len(log_w[0])), -1.0)
    log_w = torch.tensor(log_w)
    return {
        "loss_mask": torch.tensor(mask, dtype=torch.float32),
        "old_logprobs": old,
        "behavior_logprobs": old - log_w,
        "advantages": torch.ones_like(old),
    }


def test_token_tis_truncates_at_cap():
    batch = batch_with_log_w([[0.0, math.log(3), math.log(1.5), 9.0]], [[1, 1, 1, 0]])
    w, m = is_weights(batch, "token", cap=2.0)
    assert w[0].tolist() == pytest.approx([1.0, 2.0, 1.5, 1.0])  # off-mask: log w = 0
    assert float(m["is_clip_frac"]) == pytest.approx(1 / 3)
    assert float(m["is_weight_mean"]) == pytest.approx(4.5 / 3)


def test_sequence_tis_uses_product_of_token_ratios():
    batch = batch_with_log_w(
        [[math.log(2), math.log(2)], [math.log(1.5), -math.log(2)]], [[1, 1], [1, 1]]
    )
    w, m = is_weights(batch, "sequence", cap=2.0)
    assert w.tolist() == [pytest.approx([2.0, 2.0]), pytest.approx([0.75, 0.75])]
    assert float(m["is_clip_frac"]) == pytest.approx(0.5)


def test_decoupled_weights_drop_tokens_over_cap():
    batch = batch_with_log_w([[math.log(0.5), math.log(3), math.log(1.5)]], [[1, 1, 1]])
    w, m = decoupled_weights(batch, cap=2.0)
    assert w[0].tolist() == pytest.approx([0.5, 0.0, 1.5])
    assert float(m["is_clip_frac"]) == pytest.approx(1 / 3)
    uncapped, _ = decoupled_weights(batch)
    assert uncapped[0].tolist() == pytest.approx([0.5, 3.0, 1.5])


def test_corrected_loss_multiplies_plain_per_token_loss():
    batch = batch_with_log_w([[0.0, math.log(3), math.log(1.5)]], [[1, 1, 1]])
    logp = batch["old_logprobs"].clone()  # ratio 1: plain per-token loss is -A = -1
    loss, m = compute_loss(logp, batch, tis_level="token", tis_cap=2.0)
    assert float(loss) == pytest.approx(-(1 + 2 + 1.5) / 3)
    loss, _ = compute_loss(logp, batch, decoupled=True, decoupled_cap=2.0)
    assert float(loss) == pytest.approx(-(1 + 0 + 1.5) / 3)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tis_level": "token"},
        {"tis_level": "sequence", "tis_cap": 1.5},
        {"decoupled": True},
        {"decoupled": True, "decoupled_cap": 1.2},
    ],
)
@pytest.mark.parametrize("loss_fn", ["ppo_clip", "dual_clip", "gspo", "cispo"])
def test_on_policy_weights_are_exactly_one(kwargs, loss_fn):
    torch.manual_seed(0)
    logp = (torch.randn(4, 6) - 2).requires_grad_(True)
    old = logp.detach() + 0.1 * torch.randn(4, 6)
    mask = (torch.rand(4, 6) > 0.3).float()
    batch = {"loss_mask": mask, "old_logprobs": old, "behavior_logprobs": old.clone()}
    batch["advantages"] = torch.randn(4, 1) * mask
    if "tis_level" in kwargs:
        w, _ = is_weights(batch, kwargs["tis_level"], kwargs.get("tis_cap", 2.0))
    else:
        w, _ = decoupled_weights(batch, kwargs.get("decoupled_cap"))
    assert torch.equal(w, torch.ones_like(w))
    plain, _ = compute_loss(logp, batch, loss_fn=loss_fn)
    (g_plain,) = torch.autograd.grad(plain, logp)
    corrected, m = compute_loss(logp, batch, loss_fn=loss_fn, **kwargs)
    (g_corr,) = torch.autograd.grad(corrected, logp)
    assert torch.equal(plain, corrected) and torch.equal(g_plain, g_corr)
    assert float(m.get("is_clip_frac", 0.0)) == 0.0


def test_off_policy_errors_are_clear():
    batch = batch_with_log_w([[0.0]], [[1]])
    logp = batch["old_logprobs"].clone()
    with pytest.raises(ValueError, match="tis_level"):
        compute_loss(logp, batch, tis_level="tokens")
    with pytest.raises(ValueError, match="not both"):
        compute_loss(logp, batch, tis_level="token", decoupled=True)
    del batch["behavior_logprobs"]
    with pytest.raises(KeyError, match="behavior_logprobs"):
        compute_loss(logp, batch, tis_level="token")
