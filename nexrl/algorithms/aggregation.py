"""Loss aggregation: how a (B, T) per-token loss becomes one number.

Every mode divides by a *global* normaliser (`num_tokens` / `num_seqs` of the
whole optimizer step, across micro-batches and data-parallel ranks), so that
gradient accumulation and data parallelism give the same gradient as one big
batch. When no normaliser is given, the current batch's count is used.

`seq-mean-token-mean` is the exception that cannot use `num_tokens`: each
sequence's own length divides its sum, which is fine because a sequence never
spans two micro-batches.

Masked entries are selected with `where`, not multiplied by 0, so a NaN or inf
in padding can never reach the loss or the gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nexrl.algorithms.registry import Registry

AGGREGATIONS: Registry[Callable[..., torch.Tensor]] = Registry(
    "loss aggregation mode", "algorithm.loss_agg_mode"
)

Norm = float | torch.Tensor | None


@AGGREGATIONS.register("token-mean")
def token_mean(
    loss: torch.Tensor,  # (B, T)
    mask: torch.Tensor,  # (B, T)
    num_tokens: Norm = None,
    num_seqs: Norm = None,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """Sum over every unmasked token / number of tokens (DAPO)."""
    denom = num_tokens if num_tokens is not None else mask.sum()
    return _masked(loss, mask).sum() / _nonzero(denom)


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(
    loss: torch.Tensor,  # (B, T)
    mask: torch.Tensor,  # (B, T)
    num_tokens: Norm = None,
    num_seqs: Norm = None,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """Sum over each sequence's tokens, mean over sequences."""
    denom = num_seqs if num_seqs is not None else _num_seqs(mask)
    return _masked(loss, mask).sum() / _nonzero(denom)


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(
    loss: torch.Tensor,  # (B, T)
    mask: torch.Tensor,  # (B, T)
    num_tokens: Norm = None,
    num_seqs: Norm = None,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """Mean over each sequence's tokens, then mean over sequences (original GRPO)."""
    per_seq = _masked(loss, mask).sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)
    denom = num_seqs if num_seqs is not None else _num_seqs(mask)
    return per_seq.sum() / _nonzero(denom)


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss: torch.Tensor,  # (B, T)
    mask: torch.Tensor,  # (B, T)
    num_tokens: Norm = None,
    num_seqs: Norm = None,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """Token sum / num_seqs / a constant horizon (Dr.GRPO); `max_tokens` defaults to T.

    Give `max_tokens` (e.g. the max response length) when micro-batches are
    padded to different T, or accumulation is no longer exact.
    """
    horizon = max_tokens if max_tokens is not None else loss.shape[-1]
    denom = num_seqs if num_seqs is not None else _num_seqs(mask)
    return _masked(loss, mask).sum() / _nonzero(denom) / horizon


def _masked(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask > 0, loss * mask, torch.zeros_like(loss))


def _num_seqs(mask: torch.Tensor) -> torch.Tensor:
    return (mask.sum(-1) > 0).sum()


def _nonzero(x: float | torch.Tensor) -> float | torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.clamp(min=1)
    return max(float(x), 1.0)
