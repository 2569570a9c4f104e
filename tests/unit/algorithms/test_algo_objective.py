"""compute_loss and aggregation: hand values and the accumulation / DP invariances."""

import pytest
import torch

from nexrl.algorithms import AGGREGATIONS, POLICY_LOSSES, compute_loss

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "want"),
    [
        ("token-mean", 7 / 3),
        ("seq-mean-token-sum", (3 + 4) / 2),
        ("seq-mean-token-mean", (1.5 + 4) / 2),
        ("seq-mean-token-sum-norm", 7 / 2 / 3),
    ],
)
def test_aggregation_hand_values(mode, want):
    assert float(AGGREGATIONS.get(mode)(LOSS, MASK)) == pytest.approx(want)
    nan_pad = LOSS.clone()
    nan_pad[0, 2] = float("nan")
    assert float(AGGREGATIONS.get(mode)(nan_pad, MASK)) == pytest.approx(want)


def test_aggregation_global_normalisers():
    agg = AGGREGATIONS.get
    assert float(agg("token-mean")(LOSS, MASK, num_tokens=14)) == pytest.approx(0.5)
    assert float(agg("seq-mean-token-sum")(LOSS, MASK, num_seqs=7)) == pytest.approx(1.0)
    assert float(agg("seq-mean-token-sum-norm")(LOSS, MASK, max_tokens=7)) == pytest.approx(0.5)


def random_batch(b=8, t=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(b, t, generator=g) * 3).double()
    old = logp + 0.3 * torch.randn(b, t, generator=g).double()
    lengths = torch.randint(1, t, (b,), generator=g)
    mask = (torch.arange(t)[None, :] >= (t - lengths[:, None])).double()  # left prompt
    batch = {
        "loss_mask": mask,
        "old_logprobs": old,
        "behavior_logprobs": old + 0.3 * torch.randn(b, t, generator=g).double(),
        "ref_logprobs": logp + 0.2 * torch.randn(b, t, generator=g).double(),
        "advantages": torch.randn(b, 1, generator=g).double() * mask,
    }
    entropy = torch.rand(b, t, generator=g).double()
    return logp, batch, entropy


FULL = {"kl_coef": 0.05, "entropy_coef": 0.01, "tis_level": "token", "tis_cap": 1.5}
CASES = [
    (loss_fn, agg, extra)
    for loss_fn in POLICY_LOSSES.names()
    for agg in AGGREGATIONS.names()
    for extra in ({}, FULL)
]


def loss_and_grad(logp, batch, entropy, rows, loss_fn, agg, extra, norms):
    part = logp[rows].clone().requires_grad_(True)
    sub = {k: v[rows] for k, v in batch.items()}
    loss, _ = compute_loss(
        part, sub, loss_fn=loss_fn, agg_mode=agg, entropy=entropy[rows], **norms, **extra
    )
    (grad,) = torch.autograd.grad(loss, part)
    return loss.detach(), grad


@pytest.mark.parametrize(("loss_fn", "agg", "extra"), CASES)
def test_micro_batch_1x8_equals_batch_of_8(loss_fn, agg, extra):
    logp, batch, entropy = random_batch()
    mask = batch["loss_mask"]
    norms = {"num_tokens": mask.sum(), "num_seqs": 8, "max_tokens": 7}
    args = (loss_fn, agg, extra, norms)
    whole, whole_grad = loss_and_grad(logp, batch, entropy, list(range(8)), *args)
    parts = [loss_and_grad(logp, batch, entropy, [i], *args) for i in range(8)]
    assert torch.allclose(sum(p[0] for p in parts), whole)
    assert torch.allclose(torch.cat([p[1] for p in parts]), whole_grad)
    # The same with two data-parallel "ranks" of four rows each.
    ranks = [loss_and_grad(logp, batch, entropy, list(r), *args) for r in (range(4), range(4, 8))]
    assert torch.allclose(ranks[0][0] + ranks[1][0], whole)


def test_token_mean_over_two_ranks_equals_global_token_mean():
    logp, batch, _ = random_batch(seed=3)
    mask = batch["loss_mask"]
    whole, _ = compute_loss(logp, batch)  # batch-local token-mean
    num_tokens = mask[:3].sum() + mask[3:].sum()  # what an all-reduce would give
    halves = [
        compute_loss(logp[s], {k: v[s] for k, v in batch.items()}, num_tokens=num_tokens)[0]
        for s in (slice(0, 3), slice(3, 8))
    ]
    assert torch.allclose(halves[0] + halves[1], whole)


@pytest.mark.parametrize(("loss_fn", "agg", "extra"), CASES)
def test_all_masked_batch_gives_zero_loss_and_gradient(loss_fn, agg, extra):
    logp, batch, entropy = random_batch()
    batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    logp = logp.clone()
    logp[:, -1] = -float("inf")  # padding garbage must not leak
    logp.requires_grad_(True)
    loss, metrics = compute_loss(
        logp, batch, loss_fn=loss_fn, agg_mode=agg, entropy=entropy, **extra
    )
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert torch.equal(logp.grad, torch.zeros_like(logp))
    assert all(torch.isfinite(v) for v in metrics.values())


def test_default_is_ppo_clip_token_mean_without_extras():
    logp, batch, _ = random_batch(seed=1)
    loss, metrics = compute_loss(logp, batch)
    mask = batch["loss_mask"]
    ratio = torch.exp((logp - batch["old_logprobs"]) * mask)
    adv = batch["advantages"]
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    assert torch.allclose(loss, (per_token * mask).sum() / mask.sum())
    assert "is_weight_mean" not in metrics
    assert "kl" in metrics  # reported (not added) because ref_logprobs is present


def test_kl_and_entropy_terms_are_added_with_their_coefficients():
    logp, batch, entropy = random_batch(seed=2)
    mask = batch["loss_mask"]
    plain, m = compute_loss(logp, batch, entropy=entropy)
    full, _ = compute_loss(logp, batch, entropy=entropy, kl_coef=0.1, entropy_coef=0.01)
    log_r = (batch["ref_logprobs"] - logp) * mask
    kl = ((torch.exp(log_r) - 1 - log_r) * mask).sum() / mask.sum()
    ent = (entropy * mask).sum() / mask.sum()
    assert torch.allclose(m["kl"], kl) and torch.allclose(m["entropy"], ent)
    assert torch.allclose(full, plain + 0.1 * kl - 0.01 * ent)
    k1, m1 = compute_loss(logp, batch, kl_coef=0.1, kl_estimator="k1")
    assert torch.allclose(m1["kl"], ((logp - batch["ref_logprobs"]) * mask).sum() / mask.sum())


def test_config_errors_name_the_bad_key():
    logp, batch, _ = random_batch()
    with pytest.raises(TypeError, match=r"clip_ratio_c.*'ppo_clip'|'ppo_clip'.*clip_ratio_c"):
        compute_loss(logp, batch, loss_fn="ppo_clip", clip_ratio_c=3.0)
    with pytest.raises(KeyError, match="kl estimator|KL estimator"):
        compute_loss(logp, batch, kl_estimator="k4")
    with pytest.raises(KeyError, match="loss aggregation mode"):
        compute_loss(logp, batch, agg_mode="sum")
    del batch["ref_logprobs"]
    with pytest.raises(KeyError, match="ref_logprobs"):
        compute_loss(logp, batch, kl_coef=0.1)
    with pytest.raises(ValueError, match="entropy"):
        compute_loss(logp, batch, entropy_coef=0.1)


@pytest.mark.parametrize("key", ["advantages", "old_logprobs", "ref_logprobs", "loss_mask"])
def test_a_per_sequence_field_is_refused_naming_it(key):
    """(B,) instead of (B, T) would broadcast to a shape error that names no field."""
    logp, batch, _ = random_batch()
    batch[key] = batch[key][:, 0]
    rows, tokens = logp.shape
    with pytest.raises(
        ValueError, match=rf"batch\['{key}'\] has shape \({rows},\).*\({rows}, {tokens}\)"
    ):
        compute_loss(logp, batch)


def user_loss(logprobs, batch, scale: float = 1.0):
    """A user's policy loss, reached by import path."""
    return -scale * batch["advantages"] * logprobs, {}


def test_import_path_loss_and_its_kwargs_are_checked():
    logp, batch, _ = random_batch()
    mask = batch["loss_mask"]
    loss, _ = compute_loss(logp, batch, loss_fn=f"{__name__}:user_loss", scale=2.0)
    want = (-2.0 * batch["advantages"] * logp * mask).sum() / mask.sum()
    assert torch.allclose(loss, want)
    with pytest.raises(TypeError, match="scal"):
        compute_loss(logp, batch, loss_fn=f"{__name__}:user_loss", scal=2.0)
