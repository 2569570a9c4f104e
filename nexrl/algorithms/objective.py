"""The one function a trainer calls: named policy loss + KL + entropy, aggregated.

    loss, metrics = compute_loss(logprobs, batch, loss_fn="ppo_clip",
                                 agg_mode="token-mean", num_tokens=..., **kwargs)

The trainer stays algorithm-blind: everything it needs to know is a name and
a dict of keyword arguments that came from config. The defaults are plain
GRPO: PPO clip, token-mean, no KL, no entropy bonus, no off-policy correction.

Order of operations, per token: policy loss -> times the (detached) off-policy
weight -> aggregated; KL and entropy are aggregated with the same mode and
normalisers, so micro-batch accumulation and data parallelism stay exact.
"""

from __future__ import annotations

from typing import Any

import torch

from nexrl.algorithms.aggregation import AGGREGATIONS, Norm
from nexrl.algorithms.kl import KL_ESTIMATORS, kl_per_token
from nexrl.algorithms.losses import POLICY_LOSSES
from nexrl.algorithms.off_policy import decoupled_weights, is_weights
from nexrl.algorithms.registry import check_kwargs


def compute_loss(
    logprobs: torch.Tensor,  # (B, T)
    batch: dict[str, torch.Tensor],
    loss_fn: str = "ppo_clip",
    agg_mode: str = "token-mean",
    entropy: torch.Tensor | None = None,  # (B, T)
    num_tokens: Norm = None,
    num_seqs: Norm = None,
    entropy_coef: float = 0.0,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    tis_level: str | None = None,
    tis_cap: float = 2.0,
    decoupled: bool = False,
    decoupled_cap: float | None = None,
    max_tokens: int | None = None,
    **loss_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scalar loss for one micro-batch and its metrics (already aggregated).

    `num_tokens` / `num_seqs` are the global normalisers of the optimizer step
    (all micro-batches, all ranks); `max_tokens` is the horizon of
    `seq-mean-token-sum-norm`. `kl_coef > 0` reads `batch["ref_logprobs"]`.
    `tis_level` ("token" | "sequence") or `decoupled=True` read
    `batch["behavior_logprobs"]`. `loss_kwargs` go to the policy loss and must
    be parameters of it (TypeError otherwise).
    """
    policy = POLICY_LOSSES.get(loss_fn)
    check_kwargs(policy, loss_kwargs, f"policy loss {loss_fn!r}", positional=("logprobs", "batch"))
    KL_ESTIMATORS.get(kl_estimator)  # fail on a bad name even when KL is off
    if tis_level is not None and decoupled:
        raise ValueError("choose one off-policy correction: tis_level or decoupled, not both")
    _check_token_shapes(logprobs, batch)
    mask = batch["loss_mask"].to(logprobs.dtype)
    norms = {"num_tokens": num_tokens, "num_seqs": num_seqs, "max_tokens": max_tokens}
    aggregate = AGGREGATIONS.get(agg_mode)

    per_token, metrics = policy(logprobs, batch, **loss_kwargs)
    if tis_level is not None:
        weights, is_metrics = is_weights(batch, tis_level, tis_cap)
        per_token, metrics = per_token * weights, {**metrics, **is_metrics}
    elif decoupled:
        weights, is_metrics = decoupled_weights(batch, decoupled_cap)
        per_token, metrics = per_token * weights, {**metrics, **is_metrics}
    policy_loss = aggregate(per_token, mask, **norms)
    total = policy_loss
    metrics["policy_loss"] = policy_loss.detach()

    if kl_coef or "ref_logprobs" in batch:
        ref = _require(batch, "ref_logprobs", "kl_coef > 0")
        kl = aggregate(kl_per_token(logprobs, ref, mask, kl_estimator), mask, **norms)
        metrics["kl"] = kl.detach()
        if kl_coef:
            total = total + kl_coef * kl
    if entropy is not None:
        ent = aggregate(entropy, mask, **norms)
        metrics["entropy"] = ent.detach()
        if entropy_coef:
            total = total - entropy_coef * ent
    elif entropy_coef:
        raise ValueError("entropy_coef > 0 needs the per-token `entropy` tensor")
    return total, metrics


def _require(batch: dict[str, torch.Tensor], key: str, why: str) -> torch.Tensor:
    if key not in batch:
        raise KeyError(f"{why} needs batch[{key!r}]; present keys: {sorted(batch)}")
    return batch[key]


PER_TOKEN_KEYS = ("loss_mask", "advantages", "old_logprobs", "behavior_logprobs", "ref_logprobs")


def _check_token_shapes(logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> None:
    """Every per-token field has the logprobs' (batch, tokens) shape; a per-sequence one
    would otherwise broadcast into a shape error that names no field."""
    for key in PER_TOKEN_KEYS:
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.shape != logprobs.shape:
            raise ValueError(
                f"batch[{key!r}] has shape {tuple(value.shape)}; the loss needs one value per "
                f"token, shape {tuple(logprobs.shape)} (rows x tokens, as input_ids). "
                "Per-sequence values spread over the tokens with v[:, None].expand_as(input_ids)"
            )
