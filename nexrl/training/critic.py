"""A value model for PPO, GAE over its values, and the clipped value loss.

The critic is the policy's transformer with a scalar head:
`AutoModelForTokenClassification(num_labels=1)` (transformers' own class,
so any causal-LM checkpoint loads with a fresh head, zero-initialised here
so that the first values are 0). `ValueEngine` owns it with the same
optimizer, LR schedule and checkpoint format as the torch policy engine
(`checkpoint.save` / `load` read `model`, `optimizer`, `scheduler`, `step`).

Token alignment is the logprobs': `values[:, t]` is the head's output on the
hidden state *before* token t (the state that chooses token t), 0 at t = 0.
`gae` runs over the response tokens only (`response_mask`); tokens off the
mask (prompt, tool output) neither add reward nor discount, as in
`advantages._returns`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForTokenClassification

from nexrl.models.sources import resolve_model
from nexrl.training import checkpoint
from nexrl.training.config import EngineConfig
from nexrl.training.optim import make_adamw, make_scheduler


class ValueEngine:
    """A value model with its optimizer (one rank; the seed's Critic engine)."""

    def __init__(self, config: EngineConfig | dict[str, Any], model_path: str) -> None:
        self.config = EngineConfig.from_mapping(config)
        self.model_path = str(resolve_model(model_path))
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.rank, self.world_size = 0, 1
        torch.manual_seed(self.config.seed)
        model = AutoModelForTokenClassification.from_pretrained(
            self.model_path, num_labels=1, dtype=torch.float32
        )
        head = model.get_output_embeddings() or getattr(model, "score", None)
        if head is not None:
            torch.nn.init.zeros_(head.weight)
            if getattr(head, "bias", None) is not None:
                torch.nn.init.zeros_(head.bias)
        self.model = model.to(self.device)
        self.optimizer = make_adamw(
            list(self.model.parameters()),
            lr=self.config.lr,
            betas=self.config.betas,
            eps=self.config.eps,
            weight_decay=self.config.weight_decay,
        )
        self.scheduler = make_scheduler(self.optimizer, self.config)
        self._step = 0

    @property
    def step(self) -> int:
        return self._step

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T) value of the state before each token (differentiable; 0 at t = 0)."""
        out = self.model(
            input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device)
        ).logits[..., 0]  # (B, T): value after reading token t
        return torch.nn.functional.pad(out[:, :-1], (1, 0)) * attention_mask.to(out.device)

    # `checkpoint` reads model, optimizer, scheduler, step, rank and model_path: the torch
    # engine's attributes, which this engine has too
    def save(self, path: str) -> None:
        checkpoint.save(self, path)  # type: ignore[arg-type]

    def load(self, path: str) -> None:
        checkpoint.load(self, path)  # type: ignore[arg-type]


def gae(
    token_rewards: torch.Tensor,  # (B, T), or (B,) outcome rewards on the last response token
    values: torch.Tensor,  # (B, T)
    response_mask: torch.Tensor,  # (B, T)
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation: (advantages, returns), each (B, T), 0 off the mask.

    delta_t = r_t + gamma * V_next - V_t and A_t = delta_t + gamma * lam * A_next, where
    "next" is the next response token (V = 0 after the last one); returns = A + V."""
    mask = response_mask.to(values.dtype)
    rewards = token_rewards.to(values.dtype)
    if rewards.dim() == 1:
        last = mask.shape[1] - 1 - mask.flip(-1).argmax(-1)  # (B,) last response token
        per_token = torch.zeros_like(mask)
        rows = torch.arange(len(rewards))[mask.sum(-1) > 0]
        per_token[rows, last[rows]] = rewards[rows]
        rewards = per_token
    if rewards.shape != mask.shape or values.shape != mask.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and response_mask "
            f"{tuple(mask.shape)} must all be (B, T)"
        )
    advantages = torch.zeros_like(mask)
    next_value = torch.zeros(mask.shape[0], dtype=mask.dtype)
    running = torch.zeros_like(next_value)
    for t in reversed(range(mask.shape[1])):
        on = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(on, delta + gamma * lam * running, running)
        next_value = torch.where(on, values[:, t], next_value)
        advantages[:, t] = running
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def value_loss(
    values: torch.Tensor,  # (B, T) current predictions
    batch: dict[str, torch.Tensor],  # returns, loss_mask; old `values` for clipping
    value_clip: float | None = 0.2,
) -> torch.Tensor:
    """Token-mean of 0.5 (V - R)^2, PPO-clipped around the old values when given."""
    mask = batch["loss_mask"].to(values.dtype)
    returns = batch["returns"].to(values.dtype)
    err = (values - returns) ** 2
    old = batch.get("values")
    if value_clip is not None and old is not None:
        clipped = old + (values - old).clamp(-value_clip, value_clip)
        err = torch.maximum(err, (clipped - returns) ** 2)
    return 0.5 * (err * mask).sum() / mask.sum().clamp(min=1.0)
