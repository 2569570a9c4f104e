"""Synthetic token-level batches for tests and the training benchmark.

Random token ids with a prompt part (loss_mask 0) and a response part
(loss_mask 1) per row, in the layout of `nexrl.types`, so engine invariances
can be checked without any data pipeline.
"""

from __future__ import annotations

import torch

from nexrl.models.tiny import SPECIALS, VOCAB_SIZE
from nexrl.types import Batch


def random_batch(n: int = 8, t: int = 12, seed: int = 0, right_pad: bool = True) -> Batch:
    """Rows of random length with a prompt (unmasked) and a response (masked in)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.zeros(n, t, dtype=torch.long)
    attention = torch.zeros(n, t, dtype=torch.long)
    loss_mask = torch.zeros(n, t)
    for i in range(n):
        length = int(torch.randint(4, t + 1, (1,), generator=g))
        prompt = int(torch.randint(1, length - 1, (1,), generator=g))
        cols = slice(0, length) if right_pad else slice(t - length, t)
        input_ids[i, cols] = torch.randint(len(SPECIALS), VOCAB_SIZE, (length,), generator=g)
        attention[i, cols] = 1
        start = cols.start + prompt
        loss_mask[i, start : cols.stop] = 1
    adv = torch.randn(n, 1, generator=g) * loss_mask
    old = -torch.rand(n, t, generator=g) * loss_mask
    return Batch(
        {
            "input_ids": input_ids,
            "attention_mask": attention,
            "loss_mask": loss_mask,
            "advantages": adv,
            "old_logprobs": old,
            "behavior_logprobs": old.clone(),
        }
    )
