"""Policy losses: per-token loss from new / old logprobs and advantages.

Each loss takes `logprobs` (B, T) of the current policy and the batch's
tensors (`advantages`, `loss_mask`, `old_logprobs`, all (B, T)), and returns a
(B, T) per-token loss plus scalar metrics. The caller
(`objective.compute_loss`) masks, applies off-policy weights and aggregates,
so the losses never need to know about micro-batches or data parallelism.

Log-ratios are zeroed off the mask before `exp`, so garbage in padding can
never turn into inf * 0 = NaN in the loss or its gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nexrl.algorithms.registry import Registry

POLICY_LOSSES: Registry[Callable[..., tuple[torch.Tensor, Metrics]]] = Registry(
    "policy loss", "algorithm.loss_fn"
)

Metrics = dict[str, torch.Tensor]


def masked_log_ratio(logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """log(pi / pi_old) per token, 0 off the loss mask. (B, T)"""
    mask = batch["loss_mask"] > 0
    return torch.where(mask, logprobs - batch["old_logprobs"], torch.zeros_like(logprobs))


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over the mask (0 for an empty mask); a detached scalar."""
    mask = mask.to(values.dtype)
    return ((values.detach() * mask).sum() / mask.sum().clamp(min=1)).detach()


def _clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """max(-A r, -A clip(r, 1 - low, 1 + high)) and where the clipped branch wins. (B, T) each"""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(
    logprobs: torch.Tensor,  # (B, T)
    batch: dict[str, torch.Tensor],
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate; `clip_high > clip_low` is DAPO's clip-higher."""
    mask = batch["loss_mask"]
    ratio = torch.exp(masked_log_ratio(logprobs, batch))
    loss, is_clipped = _clipped_surrogate(ratio, batch["advantages"], clip_low, clip_high)
    metrics = {
        "clip_frac": masked_mean(is_clipped.float(), mask),
        "ratio_mean": masked_mean(ratio, mask),
    }
    return loss, metrics


@POLICY_LOSSES.register("dual_clip")
def dual_clip(
    logprobs: torch.Tensor,  # (B, T)
    batch: dict[str, torch.Tensor],
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float = 3.0,
) -> tuple[torch.Tensor, Metrics]:
    """PPO clip plus a bound of -A * c on negative-advantage tokens (dual-clip PPO, c > 1)."""
    if clip_ratio_c <= 1.0:
        raise ValueError(f"dual_clip: clip_ratio_c must be > 1, got {clip_ratio_c}")
    mask, adv = batch["loss_mask"], batch["advantages"]
    ratio = torch.exp(masked_log_ratio(logprobs, batch))
    loss, is_clipped = _clipped_surrogate(ratio, adv, clip_low, clip_high)
    bound = -adv * clip_ratio_c
    dual = (adv < 0) & (loss > bound)
    loss = torch.where(dual, bound, loss)
    metrics = {
        "clip_frac": masked_mean(is_clipped.float(), mask),
        "dual_clip_frac": masked_mean(dual.float(), mask),
        "ratio_mean": masked_mean(ratio, mask),
    }
    return loss, metrics


@POLICY_LOSSES.register("gspo")
def gspo(
    logprobs: torch.Tensor,  # (B, T)
    batch: dict[str, torch.Tensor],
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO: the ratio is the geometric mean of token ratios, clipped per sequence.

    Uses the GSPO-token form s_t = sg(s) * pi_t / sg(pi_t): its value is the
    sequence ratio s on every token, and with sequence-constant advantages and
    `seq-mean-token-mean` aggregation its gradient equals sequence-level GSPO.
    """
    mask = batch["loss_mask"]
    fmask = mask.to(logprobs.dtype)
    log_ratio = masked_log_ratio(logprobs, batch)
    seq_log_ratio = log_ratio.sum(-1) / fmask.sum(-1).clamp(min=1)  # (B,)
    token_log_ratio = seq_log_ratio.detach()[:, None] + logprobs - logprobs.detach()
    ratio = torch.exp(torch.where(mask > 0, token_log_ratio, torch.zeros_like(logprobs)))
    loss, is_clipped = _clipped_surrogate(ratio, batch["advantages"], clip_low, clip_high)
    has_tokens = fmask.sum(-1) > 0
    seq_ratio = torch.exp(seq_log_ratio.detach())
    metrics = {
        "clip_frac": masked_mean(is_clipped.float(), mask),
        "ratio_mean": masked_mean(seq_ratio, has_tokens),
    }
    return loss, metrics


@POLICY_LOSSES.register("cispo")
def cispo(
    logprobs: torch.Tensor,  # (B, T)
    batch: dict[str, torch.Tensor],
    clip_low: float = 1.0,
    clip_high: float = 0.28,
) -> tuple[torch.Tensor, Metrics]:
    """CISPO: -sg(clip(r, 1 - low, 1 + high)) * A * log pi; every token keeps a gradient.

    Unlike PPO clipping, a clipped token is not dropped: only its importance
    weight is bounded. The default `clip_low=1.0` means no lower bound.
    """
    mask = batch["loss_mask"]
    ratio = torch.exp(masked_log_ratio(logprobs, batch)).detach()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    safe_logprobs = torch.where(mask > 0, logprobs, torch.zeros_like(logprobs))
    loss = -weight * batch["advantages"] * safe_logprobs
    metrics = {
        "clip_frac": masked_mean((weight != ratio).float(), mask),
        "ratio_mean": masked_mean(ratio, mask),
    }
    return loss, metrics
