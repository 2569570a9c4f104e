"""DAPO's data-side tricks (arXiv 2503.14476) as pure functions.

- Dynamic sampling: groups whose rewards are all equal have zero advantage
  under any group baseline, so they only dilute the batch. `informative_groups`
  says which samples to keep; the caller keeps sampling until the batch is full.
- Overlong reward shaping: a soft length penalty that ramps from 0 to
  `-penalty_factor` over the last `buffer_len` tokens before `max_length`.
- Truncated-completion masking: samples cut off by the length limit
  (finish_reason "length") get an all-zero loss mask, so an unfinished answer is
  neither rewarded nor punished.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from nexrl.types import Trajectory


def informative_groups(
    rewards: torch.Tensor,  # (N,)
    group_index: torch.Tensor,  # (N,)
    atol: float = 0.0,
) -> torch.Tensor:
    """Bool (N,): True for samples whose group's rewards are not all equal (max - min > atol)."""
    if rewards.shape != group_index.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} "
            "must both be (N,)"
        )
    _, inverse = torch.unique(group_index, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if len(inverse) else 0
    r = rewards.to(torch.float64)
    hi = torch.full((n_groups,), -torch.inf, dtype=r.dtype).scatter_reduce(0, inverse, r, "amax")
    lo = torch.full((n_groups,), torch.inf, dtype=r.dtype).scatter_reduce(0, inverse, r, "amin")
    return ((hi - lo) > atol)[inverse]


def filter_informative(
    trajectories: Sequence[Trajectory],
    group_key: str = "uid",
    reward_key: str = "reward",
    atol: float = 0.0,
) -> list[Trajectory]:
    """The trajectories of groups (by `group_key`) whose `reward_key` values differ."""
    for i, traj in enumerate(trajectories):
        for key in (group_key, reward_key):
            if key not in traj:
                raise KeyError(f"trajectory {i} has no {key!r} (keys: {sorted(traj)})")
    ids: dict[Hashable, int] = {}
    group_index = torch.tensor([ids.setdefault(t[group_key], len(ids)) for t in trajectories])
    rewards = torch.tensor([float(t[reward_key]) for t in trajectories], dtype=torch.float64)
    keep: torch.Tensor | list[bool] = (
        informative_groups(rewards, group_index, atol) if len(trajectories) else []
    )
    return [t for t, k in zip(trajectories, keep, strict=True) if k]


def overlong_penalty(
    lengths: torch.Tensor,  # (N,) response lengths in tokens
    max_length: int,
    buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment, to be added to the rewards. (N,) float

    0 for L <= max_length - buffer_len; (max_length - buffer_len - L) / buffer_len
    * penalty_factor inside the buffer; -penalty_factor beyond max_length.
    """
    if not 0 < buffer_len <= max_length:
        raise ValueError(f"need 0 < buffer_len <= max_length, got {buffer_len}, {max_length}")
    lengths = lengths.to(torch.float32)
    start = max_length - buffer_len
    ramp = (start - lengths) / buffer_len * penalty_factor
    return torch.where(lengths <= start, 0.0, ramp).clamp(min=-penalty_factor)


def mask_truncated(
    loss_mask: torch.Tensor,  # (N, T)
    finish_reasons: Sequence[str | None],
) -> torch.Tensor:
    """A copy of `loss_mask` with the rows of finish_reason "length" set to 0. (N, T)"""
    if len(finish_reasons) != loss_mask.shape[0]:
        raise ValueError(
            f"{len(finish_reasons)} finish_reasons for a loss_mask of {loss_mask.shape[0]} rows"
        )
    truncated = torch.tensor([r == "length" for r in finish_reasons], dtype=torch.bool)
    return torch.where(truncated[:, None], torch.zeros_like(loss_mask), loss_mask)
