"""The one function a trainer calls: named policy loss + KL + entropy, aggregated.

    loss, metrics = compute_loss(logprobs, batch, loss_fn="ppo_clip",
                                 agg_mode="token-mean", num_tokens=..., **kwargs)

The trainer stays algorithm-blind: everything it needs to know is a name and
a dict of keyword arguments that came from config.
"""

from __future__ import annotations

from typing import Any

import torch

from nexrl.algorithms.aggregation import AGGREGATIONS
from nexrl.algorithms.losses import POLICY_LOSSES


def compute_loss(
    logprobs: torch.Tensor,  # (B, T)
    batch: dict[str, torch.Tensor],
    loss_fn: str = "ppo_clip",
    agg_mode: str = "token-mean",
    entropy: torch.Tensor | None = None,  # (B, T)
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    entropy_coef: float = 0.0,
    **loss_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scalar loss for one micro-batch and its metrics (already aggregated)."""
    mask = batch["loss_mask"].to(logprobs.dtype)
    per_token, metrics = POLICY_LOSSES.get(loss_fn)(logprobs, batch, **loss_kwargs)
    aggregate = AGGREGATIONS.get(agg_mode)
    policy_loss = aggregate(per_token, mask, num_tokens=num_tokens, num_seqs=num_seqs)
    total = policy_loss
    metrics = {**metrics, "policy_loss": policy_loss.detach()}
    if entropy is not None:
        ent = aggregate(entropy, mask, num_tokens=num_tokens, num_seqs=num_seqs)
        metrics["entropy"] = ent.detach()
        if entropy_coef:
            total = total - entropy_coef * ent
    return total, metrics
