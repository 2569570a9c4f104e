"""KL estimators (Schulman, "Approximating KL divergence", 2020) and the KL reward penalty.

Samples come from the current policy pi, so with log r = log pi_ref - log pi
per token:

    k1 = -log r                  unbiased, high variance, can be negative
    k2 = (log r)^2 / 2           biased, low variance, >= 0
    k3 = (r - 1) - log r         unbiased, low variance, >= 0 (GRPO's choice)

KL enters training in one of two places: as a loss term (`kl_coef` in
`objective.compute_loss`) or as a reward penalty (`apply_kl_penalty`, applied
before advantage estimation, as in PPO / REINFORCE++).

The reference is the initial policy unless told otherwise (as in verl and TRL):
`reference_model_path` gives `model_path` when a run uses KL and sets no
`train_worker.engine.ref_model_path`, so a KL run needs no extra key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from nexrl.algorithms.registry import Registry

if TYPE_CHECKING:
    from omegaconf import DictConfig

KL_ESTIMATORS: Registry[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = Registry(
    "KL estimator"
)

# exp(20) ~ 5e8: far beyond any useful KL, and far from float32 overflow.
_MAX_LOG_RATIO = 20.0


def _log_ratio(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """log(pi_ref / pi) per token. (B, T)"""
    return ref_logprobs - logprobs


@KL_ESTIMATORS.register("k1")
def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """log pi - log pi_ref. (B, T)"""
    return -_log_ratio(logprobs, ref_logprobs)


@KL_ESTIMATORS.register("k2")
def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """(log pi - log pi_ref)^2 / 2. (B, T)"""
    return 0.5 * _log_ratio(logprobs, ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """exp(log r) - 1 - log r, with log r clamped to +-20 against overflow. (B, T)"""
    log_r = _log_ratio(logprobs, ref_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(log_r) - 1.0 - log_r


def kl_per_token(
    logprobs: torch.Tensor,  # (B, T)
    ref_logprobs: torch.Tensor,  # (B, T)
    mask: torch.Tensor,  # (B, T)
    estimator: str = "k3",
) -> torch.Tensor:
    """Named estimator, 0 off the mask (padding never produces inf or NaN). (B, T)"""
    on = mask > 0
    zeros = torch.zeros_like(logprobs)
    kl = KL_ESTIMATORS.get(estimator)(
        torch.where(on, logprobs, zeros), torch.where(on, ref_logprobs, zeros)
    )
    return torch.where(on, kl, zeros)


def apply_kl_penalty(
    rewards: torch.Tensor,  # (N,) or (N, T)
    logprobs: torch.Tensor,  # (N, T)
    ref_logprobs: torch.Tensor,  # (N, T)
    response_mask: torch.Tensor,  # (N, T)
    beta: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Rewards minus beta * KL, before advantage estimation.

    Token-level rewards (N, T) get `-beta * kl_t` on every response token;
    scalar rewards (N,) get `-beta * sum_t kl_t` (the sequence KL). Logprobs
    are treated as data (detached): a reward penalty carries no gradient.
    Returns the penalised rewards (same shape) and `{"kl_penalty_seq_mean": ...}`.
    """
    kl = kl_per_token(logprobs.detach(), ref_logprobs.detach(), response_mask, estimator)
    seq_kl = kl.sum(-1)  # (N,)
    if rewards.dim() == 1:
        penalised = rewards - beta * seq_kl
    elif rewards.shape == kl.shape:
        penalised = rewards - beta * kl
    else:
        raise ValueError(
            f"rewards must be (N,) or (N, T) = {tuple(kl.shape)}, got {tuple(rewards.shape)}"
        )
    return penalised, {"kl_penalty_seq_mean": seq_kl.mean() if len(seq_kl) else seq_kl.sum()}


def uses_kl(cfg: DictConfig) -> bool:
    """The run reads reference logprobs: a KL reward penalty or a KL loss term."""
    loss_kwargs = cfg.algorithm.get("loss_kwargs") or {}
    return cfg.algorithm.kl_in_reward_coef > 0 or float(loss_kwargs.get("kl_coef", 0) or 0) > 0


def reference_model_path(cfg: DictConfig) -> str | None:
    """`train_worker.engine.ref_model_path`, or the initial policy (`model_path`) when the
    run uses KL and names no reference; None: no reference model is loaded."""
    given = cfg.train_worker.engine.get("ref_model_path")
    if given:
        return str(given)
    return str(cfg.model_path) if uses_kl(cfg) else None
