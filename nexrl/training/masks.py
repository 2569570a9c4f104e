"""Attention masks built in a few tensor ops instead of by transformers' `torch.vmap`.

For a padded batch under SDPA, transformers (4.5x) builds the 4D mask of every
forward by vmapping Python mask functions over the batch, query and key indices:
about 1.9 ms of interpreter time per forward on the default run, two forwards per
train step, with the GIL held while the engine thread beside the trainer waits for
it. A 4D boolean mask passed in is used as it is, so for full-attention models under
SDPA the trainer passes one built here (`model_attention_mask`); anything else
(sliding windows, chunked attention, eager or flash kernels) keeps the 2D mask and
transformers' own construction.
"""

from __future__ import annotations

import torch


def full_attention(config) -> bool:
    """Every layer attends to the whole past (no sliding window, no chunks)."""
    config = config.get_text_config()
    full = all(t == "full_attention" for t in getattr(config, "layer_types", None) or [])
    window = getattr(config, "sliding_window", None) or getattr(
        config, "attention_chunk_size", None
    )
    return full and not window


def dense_masks_apply(model: torch.nn.Module) -> bool:
    """Whether `model` (the transformers model, unwrapped) may take a 4D bool mask."""
    config = model.config
    return getattr(config, "_attn_implementation", None) == "sdpa" and full_attention(config)


def causal_padding_mask(key_mask: torch.Tensor, q_len: int) -> torch.Tensor:
    """(b, 1, q_len, K) bool: the queries are the last `q_len` of the K keys, each sees
    the real keys (`key_mask` (b, K)) up to itself, and always itself (a padding query
    then has a finite output, which the loss masks, instead of NaN)."""
    k = key_mask.shape[1]
    keys = torch.arange(k, device=key_mask.device)
    queries = keys[k - q_len :, None]  # (q_len, 1)
    mask = (keys[None] <= queries)[None, None] & key_mask.bool()[:, None, None, :]
    return mask | (keys[None] == queries)[None, None]


def model_attention_mask(key_mask: torch.Tensor, q_len: int, dense: bool) -> torch.Tensor:
    """The `attention_mask` argument: `key_mask` itself without padding (SDPA's causal
    fast path) or when `dense` is False, else `causal_padding_mask`."""
    if not dense or bool(key_mask.all()):
        return key_mask
    return causal_padding_mask(key_mask, q_len)
