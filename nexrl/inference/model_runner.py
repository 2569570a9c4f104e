"""A lean forward pass for the Llama / Qwen2 / Qwen3 family with a slot KV cache.

Why not the HF forward: at decode time on a CPU the tiny models spend most of
their time in Python (module calls, cache objects, mask building). This runner
reads the weights of the model `from_pretrained` built (so it is the same
checkpoint, and `load_state_dict` updates reach it after `refresh()`), fuses
q/k/v and gate/up into single matmuls, and runs one forward for the whole
running batch with a preallocated cache.

Cache layout: one tensor per layer for K and V, `(slots, kv_heads, max_len,
head_dim)`. A running sequence owns one slot (one row); the scheduler keeps
the running rows dense at `[0, B)` by moving rows when sequences finish
(`move_rows`), so a decode step attends over the view `[:B, :, :L]`.
Prefix sharing: the `n` samples of a prompt are prefilled once and the prompt
KV is copied into their `n` rows.

Attention of a decode step folds the GQA group into the query axis and runs
two strided batched matmuls straight on the cache (no K/V repeat, no copy);
it beat SDPA's CPU kernel for one-token queries in our measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def is_supported(model: torch.nn.Module) -> bool:
    """True when the lean forward covers `model` (else use the HF engine)."""
    cfg = model.config
    arch_ok = type(model).__name__ in SUPPORTED_ARCHITECTURES
    return arch_ok and cfg.hidden_act == "silu" and not getattr(cfg, "use_sliding_window", False)


def _cat(*ts: torch.Tensor | None) -> torch.Tensor | None:
    if all(t is None for t in ts):
        return None
    return torch.cat([t if t is not None else torch.zeros(0) for t in ts], dim=0)


@dataclass
class _Layer:
    ln1: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    ln2: torch.Tensor
    gate_up_w: torch.Tensor
    gate_up_b: torch.Tensor | None
    down_w: torch.Tensor
    down_b: torch.Tensor | None


def _layer(block: torch.nn.Module) -> _Layer:
    attn, mlp = block.self_attn, block.mlp
    qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return _Layer(
        ln1=block.input_layernorm.weight,
        qkv_w=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
        qkv_b=_cat(attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias),
        o_w=attn.o_proj.weight,
        o_b=attn.o_proj.bias,
        q_norm=qn.weight if qn is not None else None,
        k_norm=kn.weight if kn is not None else None,
        ln2=block.post_attention_layernorm.weight,
        gate_up_w=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
        gate_up_b=_cat(mlp.gate_proj.bias, mlp.up_proj.bias),
        down_w=mlp.down_proj.weight,
        down_b=mlp.down_proj.bias,
    )


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in float32, scale in the model dtype (one fused op in fp32)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE: x * cos + rotate_half(x) * sin, with rotate_half folded into roll + signed sin."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


class ModelRunner:
    """Owns the cache and runs prefill / decode forwards. Not thread-safe: one owner thread."""

    def __init__(self, model: torch.nn.Module, max_slots: int, max_len: int) -> None:
        if not is_supported(model):
            raise ValueError(f"lean forward does not support {type(model).__name__}")
        cfg = model.config
        self.model = model
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.max_slots, self.max_len = max_slots, max_len
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        shape = (max_slots, self.n_kv, max_len, self.head_dim)
        n_layers = cfg.num_hidden_layers
        self.k_cache = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(n_layers)
        ]
        self.v_cache = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(n_layers)
        ]
        self._rope_table(max_len)
        self.refresh()

    @torch.inference_mode()
    def _rope_table(self, max_len: int) -> None:
        pos = torch.arange(max_len, device=self.device)[None]
        dummy = torch.zeros(1, dtype=torch.float32, device=self.device)
        cos, sin = self.model.model.rotary_emb(dummy, pos)  # (1, L, D) each
        half = cos.shape[-1] // 2
        sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(sin.device)
        self.cos, self.sin = cos[0].to(self.dtype), (sin[0] * sign).to(self.dtype)  # (L, D)

    @torch.inference_mode()
    def refresh(self) -> None:
        """Rebuild the fused weights from the model's parameters (after a weight update)."""
        inner = self.model.model
        self.embed = inner.embed_tokens.weight
        self.final_norm = inner.norm.weight
        self.lm_head = self.model.lm_head.weight
        self.layers = [_layer(block) for block in inner.layers]

    # -- cache bookkeeping ------------------------------------------------------------------
    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy cache rows `src` to rows `dst` (both (M,) long)."""
        for k, v in zip(self.k_cache, self.v_cache, strict=True):
            k[dst] = k[src]
            v[dst] = v[src]

    # -- forwards ---------------------------------------------------------------------------
    def _qkv(self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h (N, S, H) -> q (N, heads, S, D), k and v (N, kv_heads, S, D), rotated."""
        n, s, _ = h.shape
        qkv = F.linear(h, layer.qkv_w, layer.qkv_b)
        d = self.head_dim
        q, k, v = qkv.split([self.n_heads * d, self.n_kv * d, self.n_kv * d], dim=-1)
        q = q.view(n, s, self.n_heads, d).transpose(1, 2)
        k = k.view(n, s, self.n_kv, d).transpose(1, 2)
        v = v.view(n, s, self.n_kv, d).transpose(1, 2)
        if layer.q_norm is not None:
            q, k = _rms(q, layer.q_norm, self.eps), _rms(k, layer.k_norm, self.eps)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        h = _rms(x, layer.ln2, self.eps)
        gate, up = F.linear(h, layer.gate_up_w, layer.gate_up_b).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer.down_w, layer.down_b)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_rms(x, self.final_norm, self.eps), self.lm_head).float()

    @torch.inference_mode()
    def prefill(
        self, tokens: torch.Tensor, lengths: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
    ) -> torch.Tensor:
        """Run prompts and fill the cache; returns last-position logits (R, V) float.

        tokens (R, P) right-padded prompts, lengths (R,); prompt `src[i]` is copied into
        cache row `dst[i]` (a prompt with n samples appears n times in `src`).
        """
        r, p = tokens.shape
        cos, sin = self.cos[:p], self.sin[:p]
        x = F.embedding(tokens, self.embed)  # (R, P, H)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, _rms(x, layer.ln1, self.eps), cos, sin)
            self.k_cache[i][dst, :, :p] = k[src]
            self.v_cache[i][dst, :, :p] = v[src]
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + F.linear(att.transpose(1, 2).reshape(r, p, -1), layer.o_w, layer.o_b)
            x = self._mlp(layer, x)
        last = x[torch.arange(r, device=x.device), lengths - 1]  # (R, H)
        return self._logits(last)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, pos: torch.Tensor, span: int) -> torch.Tensor:
        """One step for rows [0, B): tokens (B,) at positions pos (B,); returns logits (B, V).

        `span` = max(pos) + 1, the cache length attended to.
        """
        b, kv, d = tokens.shape[0], self.n_kv, self.head_dim
        # flat cache index of (row, kv head, pos) for index_copy_, shared by all layers
        heads = torch.arange(kv, device=pos.device)
        rows = torch.arange(b, device=pos.device)
        flat = ((rows[:, None] * kv + heads[None]) * self.max_len + pos[:, None]).flatten()
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # (B, 1, D)
        visible = torch.arange(span, device=pos.device)[None] <= pos[:, None]  # (B, L)
        bias = torch.zeros(b, 1, span, dtype=self.dtype).masked_fill_(~visible[:, None], -1e30)
        x = F.embedding(tokens, self.embed)  # (B, H)
        for i, layer in enumerate(self.layers):
            q, k, v = self._decode_qkv(layer, _rms(x, layer.ln1, self.eps), cos, sin)
            kc, vc = self.k_cache[i], self.v_cache[i]
            kc.view(-1, d).index_copy_(0, flat, k.reshape(b * kv, d))
            vc.view(-1, d).index_copy_(0, flat, v.reshape(b * kv, d))
            att = self._decode_attention(q, kc, vc, bias, b, span)
            x = x + F.linear(att.reshape(b, -1), layer.o_w, layer.o_b)
            x = self._mlp(layer, x)
        return self._logits(x)

    def _decode_qkv(self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h (B, H) -> q (B, heads, D), k and v (B, kv_heads, D); RoPE on q and k in one go."""
        nh, kv, d = self.n_heads, self.n_kv, self.head_dim
        qkv = F.linear(h, layer.qkv_w, layer.qkv_b).view(h.shape[0], nh + 2 * kv, d)
        v = qkv[:, nh + kv :]
        if layer.q_norm is None:
            qk = _rotate(qkv[:, : nh + kv], cos, sin)
            return qk[:, :nh], qk[:, nh:], v
        q = _rotate(_rms(qkv[:, :nh], layer.q_norm, self.eps), cos, sin)
        k = _rotate(_rms(qkv[:, nh : nh + kv], layer.k_norm, self.eps), cos, sin)
        return q, k, v

    def _decode_attention(self, q, kc, vc, bias, b: int, span: int) -> torch.Tensor:
        """q (B, heads, D) against cache rows [0, B) up to `span`; returns (B*kv, group, D).

        The GQA group goes on the query axis and the cache is viewed as (slots*kv, len, D),
        so both matmuls are strided batched GEMMs over the cache without copies.
        """
        d, group = self.head_dim, self.n_heads // self.n_kv
        q = q.reshape(b * self.n_kv, group, d)
        k = kc.view(-1, self.max_len, d)[: b * self.n_kv, :span]  # (B*kv, L, D)
        v = vc.view(-1, self.max_len, d)[: b * self.n_kv, :span]
        scores = torch.bmm(q, k.transpose(1, 2)).view(b, self.n_heads, span)
        probs = torch.softmax(scores * d**-0.5 + bias, dim=-1)
        return torch.bmm(probs.view(b * self.n_kv, group, span), v)
