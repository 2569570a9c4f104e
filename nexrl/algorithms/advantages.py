"""Advantage estimators: scalar rewards per sample to token-level advantages.

Each estimator takes `rewards` (N,), `group_index` (N,) (samples of one prompt
share an index) and `response_mask` (N, T), and returns (N, T) advantages that
are zero off the mask. Outcome rewards are broadcast over the response tokens:
with one reward per sample and no discount, the return of every token is the
reward, so no critic and no per-token bookkeeping is needed.

REINFORCE++ also accepts token-level rewards (N, T), which is what a per-token
KL reward penalty (`kl.apply_kl_penalty`) produces; its returns are then the
(discounted) reverse cumulative sums over the response tokens.

Estimators take only the keyword arguments they use: config passes its keys
straight through, and a misspelt key must raise instead of being ignored.

Groups are formed by episode. An agent episode whose turns did not merge into one
sample made several samples, all carrying the episode's reward; the processor then
passes `episode_index` (N,) to the estimators that take it, and their group
statistics count each episode once (`group_stats`), so every sample of an episode
gets the episode's advantage. REINFORCE++ takes no groups: its whitening is over
response tokens, and an episode's tokens are in its samples once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nexrl.algorithms.registry import Registry

ADVANTAGE_ESTIMATORS: Registry[Callable[..., torch.Tensor]] = Registry(
    "advantage estimator", "algorithm.advantage_estimator"
)


def group_stats(
    rewards: torch.Tensor,  # (N,)
    group_index: torch.Tensor,  # (N,)
    episode_index: torch.Tensor | None = None,  # (N,)
) -> tuple[torch.Tensor, ...]:
    """Per-sample mean, std (unbiased, 0 for singletons) and size of its group, each (N,).

    `episode_index`: samples of one episode share an index (an agent episode whose turns
    did not merge made several samples). Each episode then counts once, however many
    samples it made: a sample weighs 1 / its episode's sample count, a group's size is its
    number of episodes and the unbiased variance divides by episodes - 1. When an
    episode's samples carry its one reward, these are the statistics of the episodes'
    rewards (verl-agent's episode-level baseline, `compute_mean_std_cross_steps=False`).
    """
    if rewards.shape != group_index.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} "
            "must both be (N,)"
        )
    if episode_index is None:
        _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
        weights = None
    else:
        weights = _episode_weights(episode_index, rewards)
        _, inverse = torch.unique(group_index, return_inverse=True)
        size = int(inverse.max()) + 1 if len(inverse) else 0
        episodes = torch.zeros(size, dtype=rewards.dtype).index_add_(0, inverse, weights)
        counts = episodes.round().long()
    values = rewards if weights is None else rewards * weights
    sums = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, inverse, values)
    mean = (sums / counts)[inverse]
    dev = (rewards - mean) ** 2
    dev = dev if weights is None else dev * weights
    sq = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, inverse, dev)
    var = sq / (counts - 1).clamp(min=1)
    return mean, var.sqrt()[inverse], counts[inverse]


def _episode_weights(episode_index: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """(N,): 1 / the number of samples of each sample's episode."""
    if episode_index.shape != rewards.shape:
        raise ValueError(
            f"episode_index {tuple(episode_index.shape)} must be (N,) like rewards "
            f"{tuple(rewards.shape)}"
        )
    _, in_episode, sizes = torch.unique(episode_index, return_inverse=True, return_counts=True)
    return 1.0 / sizes[in_episode].to(rewards.dtype)


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(
    rewards: torch.Tensor,  # (N,)
    group_index: torch.Tensor,  # (N,)
    response_mask: torch.Tensor,  # (N, T)
    eps: float = 1e-6,
    episode_index: torch.Tensor | None = None,  # (N,)
) -> torch.Tensor:
    """(r - mean_group) / (std_group + eps), broadcast over response tokens. (N, T)"""
    mean, std, _ = group_stats(rewards, group_index, episode_index)
    scores = (rewards - mean) / (std + eps)
    return scores[:, None] * response_mask


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo(
    rewards: torch.Tensor,  # (N,)
    group_index: torch.Tensor,  # (N,)
    response_mask: torch.Tensor,  # (N, T)
    episode_index: torch.Tensor | None = None,  # (N,)
) -> torch.Tensor:
    """r - mean_group: GRPO without the std division (Dr.GRPO). (N, T)"""
    mean, _, _ = group_stats(rewards, group_index, episode_index)
    return (rewards - mean)[:, None] * response_mask


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(
    rewards: torch.Tensor,  # (N,)
    group_index: torch.Tensor,  # (N,)
    response_mask: torch.Tensor,  # (N, T)
    episode_index: torch.Tensor | None = None,  # (N,)
) -> torch.Tensor:
    """r - mean of the *other* samples (episodes) of the group; 0 for a group of one. (N, T)

    Equal to n / (n - 1) * (r - mean_group) for a group of n.
    """
    mean, _, counts = group_stats(rewards, group_index, episode_index)
    n = counts.to(rewards.dtype)
    scores = torch.where(counts > 1, (rewards - mean) * n / (n - 1).clamp(min=1), 0.0)
    return scores[:, None] * response_mask


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
def reinforce_plus_plus(
    rewards: torch.Tensor,  # (N,) or (N, T)
    group_index: torch.Tensor,  # (N,)
    response_mask: torch.Tensor,  # (N, T)
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Returns-to-go whitened over every response token of the batch (REINFORCE++). (N, T)"""
    returns = _returns(rewards, response_mask, gamma)
    return _whiten(returns, response_mask, eps)


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(
    rewards: torch.Tensor,  # (N,) or (N, T)
    group_index: torch.Tensor,  # (N,)
    response_mask: torch.Tensor,  # (N, T)
    gamma: float = 1.0,
    eps: float = 1e-8,
    episode_index: torch.Tensor | None = None,  # (N,)
) -> torch.Tensor:
    """REINFORCE++-baseline: subtract the group-mean total reward, then whiten the batch. (N, T)

    The baseline of a sample is the mean over its group (of episodes, with
    `episode_index`) of the summed (undiscounted) rewards; it is subtracted from the
    return of every token.
    """
    mask = response_mask.to(rewards.dtype)
    totals = rewards if rewards.dim() == 1 else (rewards * mask).sum(-1)
    baseline, _, _ = group_stats(totals, group_index, episode_index)
    returns = _returns(rewards, response_mask, gamma) - baseline[:, None] * mask
    return _whiten(returns, response_mask, eps)


def _returns(rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reverse (discounted) cumsum over response tokens; (N,) rewards sit on the last one."""
    mask = response_mask.to(rewards.dtype if rewards.is_floating_point() else torch.float32)
    if rewards.dim() == 1:
        token_rewards = torch.zeros_like(mask)
        has_tokens = mask.sum(-1) > 0
        last = mask.shape[1] - 1 - mask.flip(-1).argmax(-1)  # (N,) index of last response token
        rows = torch.arange(len(rewards))[has_tokens]
        token_rewards[rows, last[has_tokens]] = rewards[has_tokens].to(mask.dtype)
    elif rewards.shape == mask.shape:
        token_rewards = rewards * mask
    else:
        raise ValueError(
            f"rewards must be (N,) or (N, T) = {tuple(mask.shape)}, got {tuple(rewards.shape)}"
        )
    if gamma == 1.0:
        return token_rewards.flip(-1).cumsum(-1).flip(-1) * mask
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(mask.shape[0], dtype=mask.dtype)
    for t in reversed(range(mask.shape[1])):
        # Tokens off the mask (prompt, tool output) neither add reward nor discount.
        running = torch.where(mask[:, t] > 0, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * mask


def _whiten(values: torch.Tensor, mask: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries of the whole batch; 0 off-mask.

    `var` is the unbiased (Bessel-corrected, n - 1) variance, as in verl's
    `masked_whiten`, so advantages match the reference REINFORCE++ numbers. It
    is undefined for fewer than two response tokens, which raises.
    """
    mask = mask.to(values.dtype)
    n = mask.sum()
    if n < 2:
        raise ValueError(
            f"REINFORCE++ whitening needs at least 2 response tokens in the batch, got {int(n)}"
        )
    mean = (values * mask).sum() / n
    var = (((values - mean) * mask) ** 2).sum() / (n - 1)
    return (values - mean) * torch.rsqrt(var + eps) * mask
