"""Policy losses: per-token loss from new / old logprobs and advantages.

Each loss takes `logprobs` (B, T) of the current policy and the batch's
tensors, and returns a (B, T) per-token loss plus scalar metrics. The caller
(`objective.compute_loss`) masks and aggregates, so the losses never need to
know about micro-batches or data parallelism.
"""

from __future__ import annotations

import torch

from nexrl.algorithms.registry import Registry

POLICY_LOSSES = Registry("policy loss")


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(
    logprobs: torch.Tensor,  # (B, T)
    batch: dict[str, torch.Tensor],
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    **_: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate; `clip_high > clip_low` is DAPO's clip-higher."""
    adv = batch["advantages"]
    mask = batch["loss_mask"]
    ratio = torch.exp(logprobs - batch["old_logprobs"])
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    n = mask.sum().clamp(min=1)
    metrics = {
        "clip_frac": ((clipped > unclipped).float() * mask).sum() / n,
        "ratio_mean": (ratio.detach() * mask).sum() / n,
    }
    return loss, metrics
