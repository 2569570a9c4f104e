"""Advantage estimators: scalar rewards per sample to token-level advantages.

Each estimator takes `rewards` (N,), `group_index` (N,) (samples of one prompt
share an index) and `response_mask` (N, T), and returns (N, T) advantages that
are zero off the mask.
"""

from __future__ import annotations

import torch

from nexrl.algorithms.registry import Registry

ADVANTAGE_ESTIMATORS = Registry("advantage estimator")


def group_stats(rewards: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-sample mean, std (unbiased, 0 for singletons) and size of its group."""
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, inverse, rewards)
    mean = (sums / counts)[inverse]
    sq = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, inverse, (rewards - mean) ** 2)
    var = sq / (counts - 1).clamp(min=1)
    return mean, var.sqrt()[inverse], counts[inverse]


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(
    rewards: torch.Tensor,  # (N,)
    group_index: torch.Tensor,  # (N,)
    response_mask: torch.Tensor,  # (N, T)
    eps: float = 1e-6,
    **_: object,
) -> torch.Tensor:
    """(r - mean_group) / (std_group + eps), broadcast over response tokens."""
    mean, std, _ = group_stats(rewards, group_index)
    scores = (rewards - mean) / (std + eps)
    return scores[:, None] * response_mask
