"""Loss aggregation: how a (B, T) per-token loss becomes one number.

Every mode divides by a *global* normaliser (`num_tokens` / `num_seqs` of the
whole optimizer step, across micro-batches and data-parallel ranks), so that
gradient accumulation and data parallelism give the same gradient as one big
batch. When no normaliser is given, the current batch's count is used.
"""

from __future__ import annotations

import torch

from nexrl.algorithms.registry import Registry

AGGREGATIONS = Registry("loss aggregation mode")


@AGGREGATIONS.register("token-mean")
def token_mean(
    loss: torch.Tensor,  # (B, T)
    mask: torch.Tensor,  # (B, T)
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """Mean over every unmasked token of the batch (DAPO)."""
    denom = num_tokens if num_tokens is not None else mask.sum()
    return (loss * mask).sum() / _nonzero(denom)


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(loss, mask, num_tokens=None, num_seqs=None, max_tokens=None):
    """Sum over each sequence's tokens, mean over sequences."""
    denom = num_seqs if num_seqs is not None else _num_seqs(mask)
    return (loss * mask).sum() / _nonzero(denom)


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(loss, mask, num_tokens=None, num_seqs=None, max_tokens=None):
    """Mean over each sequence's tokens, then mean over sequences (original GRPO)."""
    per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    denom = num_seqs if num_seqs is not None else _num_seqs(mask)
    return per_seq.sum() / _nonzero(denom)


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss, mask, num_tokens=None, num_seqs=None, max_tokens=None):
    """Token sum divided by a constant length (Dr.GRPO); `max_tokens` defaults to T."""
    horizon = max_tokens if max_tokens is not None else loss.shape[-1]
    denom = num_seqs if num_seqs is not None else _num_seqs(mask)
    return (loss * mask).sum() / _nonzero(denom) / horizon


def _num_seqs(mask: torch.Tensor) -> torch.Tensor:
    return (mask.sum(-1) > 0).sum()


def _nonzero(x: float | torch.Tensor) -> float | torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.clamp(min=1)
    return max(float(x), 1.0)
