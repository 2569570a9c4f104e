"""Policy losses against hand-computed values and gradients."""

import math

import pytest
import torch

from nexrl.algorithms import POLICY_LOSSES


def make(ratios, adv, mask=None, logp=None):
    ratios = torch.tensor([ratios], dtype=torch.float64)
    old = torch.full_like(ratios, -1.0) if logp is None else torch.tensor([logp]) - ratios.log()
    logp = (old + ratios.log()).clone().requires_grad_(True)
    mask = torch.ones_like(ratios) if mask is None else torch.tensor([mask], dtype=torch.float64)
    batch = {"advantages": torch.tensor([adv], dtype=torch.float64), "loss_mask": mask}
    batch["old_logprobs"] = old
    return logp, batch


def test_ppo_clip_symmetric_and_clip_higher():
    logp, batch = make([1.5, 0.5, 1.0, 1.1], [1.0, -1.0, 1.0, -1.0])
    loss, metrics = POLICY_LOSSES.get("ppo_clip")(logp, batch)
    assert loss[0].tolist() == pytest.approx([-1.2, 0.8, -1.0, 1.1])
    assert float(metrics["clip_frac"]) == pytest.approx(0.5)
    loss.sum().backward()
    # d/dlogp of -A r is -A r; clipped tokens have no gradient.
    assert logp.grad[0].tolist() == pytest.approx([0.0, 0.0, -1.0, 1.1])
    loss_hi, _ = POLICY_LOSSES.get("ppo_clip")(logp, batch, clip_low=0.2, clip_high=0.28)
    assert loss_hi[0].tolist() == pytest.approx([-1.28, 0.8, -1.0, 1.1])


def test_dual_clip_bounds_negative_advantages():
    logp, batch = make([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0])
    loss, metrics = POLICY_LOSSES.get("dual_clip")(logp, batch, clip_ratio_c=3.0)
    assert loss[0].tolist() == pytest.approx([3.0, 2.0, -1.2])
    assert float(metrics["dual_clip_frac"]) == pytest.approx(1 / 3)
    loss.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, 2.0, 0.0])
    with pytest.raises(ValueError, match="clip_ratio_c"):
        POLICY_LOSSES.get("dual_clip")(logp, batch, clip_ratio_c=1.0)


def test_gspo_sequence_ratio_and_sequence_clip():
    # seq 0: token log-ratios 0.1, 0.3 -> s = exp(0.2), clipped at 1 + 4e-4 for A > 0
    # seq 1: token log-ratios 0, 0 -> s = 1, A < 0, unclipped
    logp, batch = make([math.exp(0.1), math.exp(0.3)], [1.0, 1.0])
    logp2, batch2 = make([1.0, 1.0], [-1.0, -1.0])
    logp = torch.cat([logp.detach(), logp2.detach()]).requires_grad_(True)
    batch = {k: torch.cat([batch[k], batch2[k]]) for k in batch}
    loss, metrics = POLICY_LOSSES.get("gspo")(logp, batch)
    assert loss.flatten().tolist() == pytest.approx([-1.0004, -1.0004, 1.0, 1.0])
    assert float(metrics["clip_frac"]) == pytest.approx(0.5)
    assert float(metrics["ratio_mean"]) == pytest.approx((math.exp(0.2) + 1) / 2)
    loss.sum().backward()
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, 0.0, 1.0, 1.0])


def test_gspo_gradient_equals_sequence_level_objective():
    torch.manual_seed(0)
    logp = (torch.randn(3, 5, dtype=torch.float64) * 0.1 - 1).requires_grad_(True)
    old = logp.detach() + torch.randn(3, 5, dtype=torch.float64) * 0.05
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]], dtype=torch.float64)
    adv = torch.tensor([[0.7], [-1.2], [0.3]], dtype=torch.float64) * mask
    batch = {"advantages": adv, "loss_mask": mask, "old_logprobs": old}
    loss, _ = POLICY_LOSSES.get("gspo")(logp, batch, clip_low=10.0, clip_high=10.0)
    ((loss * mask).sum(-1) / mask.sum(-1)).mean().backward()
    token_grad = logp.grad.clone()
    logp.grad = None
    s = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))  # paper: per-sequence ratio
    (-adv[:, 1] * s).mean().backward()
    assert torch.allclose(token_grad, logp.grad)


def test_cispo_keeps_gradient_of_clipped_tokens():
    logp, batch = make([2.0, 0.5], [1.0, 1.0], logp=[-0.5, -1.0])
    loss, metrics = POLICY_LOSSES.get("cispo")(logp, batch, clip_high=0.28)
    assert loss[0].tolist() == pytest.approx([1.28 * 0.5, 0.5 * 1.0])
    assert float(metrics["clip_frac"]) == pytest.approx(0.5)
    loss.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([-1.28, -0.5])


@pytest.mark.parametrize("name", ["ppo_clip", "dual_clip", "gspo", "cispo"])
def test_garbage_in_padding_never_reaches_loss_or_grad(name):
    logp = torch.tensor([[-1.0, -float("inf")]], requires_grad=True)
    batch = {
        "advantages": torch.tensor([[1.0, 1.0]]),
        "loss_mask": torch.tensor([[1.0, 0.0]]),
        "old_logprobs": torch.tensor([[-1.0, 50.0]]),
    }
    loss, metrics = POLICY_LOSSES.get(name)(logp, batch)
    (loss * batch["loss_mask"]).sum().backward()
    assert torch.isfinite(loss[0, 0])
    assert torch.isfinite(logp.grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())
