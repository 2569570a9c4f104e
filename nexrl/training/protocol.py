"""The train-side process boundary.

A `TrainEngine` is algorithm-blind: it receives token-level tensors (see
`nexrl.types` for the layout) and the *name* of a registered policy loss with
its keyword arguments, and it returns metrics. Advantages, KL and importance
weights are computed before the batch reaches it.

Implementations: the built-in torch engine in this process, and a remote
train service over HTTP.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from nexrl.types import Batch


@runtime_checkable
class TrainEngine(Protocol):
    @property
    def step(self) -> int:
        """Number of optimizer steps taken so far."""
        ...

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """(B, T) logprob of each token of `input_ids` under the current weights."""
        ...

    def train_batch(
        self, batch: Batch, loss_fn: str, loss_kwargs: dict[str, Any]
    ) -> dict[str, float]:
        """One optimizer step on `batch` with the registered loss `loss_fn`."""
        ...

    def save(self, path: str) -> None:
        """HF-format weights plus optimizer / scheduler / RNG / step under `path`."""
        ...

    def load(self, path: str) -> None: ...

    def export_weights(
        self, path: str | None = None, copy: bool = True
    ) -> dict[str, torch.Tensor] | str:
        """Weights for the inference side: a state dict, or a directory if `path` is set.
        `copy=False`: the state dict may share memory with the trainer, valid until its
        next step (for a caller that copies it into an engine before then)."""
        ...
