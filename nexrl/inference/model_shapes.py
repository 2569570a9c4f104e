"""What the lean forward (`model_runner.py`) reads of a Llama-style HF causal LM.

Structural types for `LlamaForCausalLM`, `Qwen2ForCausalLM` and `Qwen3ForCausalLM`: the
attribute paths that `ModelRunner` follows, typed (torch's `Module.__getattr__` types every
submodule as `Tensor | Module`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import torch


class Linear(Protocol):
    weight: torch.Tensor
    bias: torch.Tensor | None


class Norm(Protocol):
    weight: torch.Tensor


class Attention(Protocol):
    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear


class MLP(Protocol):
    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear


class DecoderBlock(Protocol):
    self_attn: Attention
    mlp: MLP
    input_layernorm: Norm
    post_attention_layernorm: Norm


class DecoderConfig(Protocol):
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    hidden_size: int
    hidden_act: str
    rms_norm_eps: float


class DecoderStack(Protocol):
    embed_tokens: Norm  # (its `weight`: the embedding table)
    layers: Sequence[DecoderBlock]
    norm: Norm

    def rotary_emb(
        self, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class CausalLM(Protocol):
    config: DecoderConfig
    model: DecoderStack
    lm_head: Linear

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...


SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def is_supported(model: CausalLM) -> bool:
    """True when the lean forward covers `model` (else use the HF engine)."""
    cfg = model.config
    arch_ok = type(model).__name__ in SUPPORTED_ARCHITECTURES
    return arch_ok and cfg.hidden_act == "silu" and not getattr(cfg, "use_sliding_window", False)
