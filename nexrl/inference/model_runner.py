"""A lean forward pass for the Llama / Qwen2 / Qwen3 family with a slot KV cache.

Why not the HF forward: at decode time the tiny models spend most of their time in
Python (module calls, cache objects, mask building). This runner reads the weights of
the model `from_pretrained` built (the same checkpoint; `load_state_dict` updates reach
it after `refresh()`), fuses q/k/v and gate/up into single matmuls (a joined copy, or none
where they already lie in one tensor: the trainer's layout, `weights.join_projections`,
that a sync run in one process shares with the engine), and runs one
forward for the whole running batch with a preallocated cache. Linears go through
`kernels.linear_for` (oneDNN for large products on a CPU). On a GPU the decode step is
replayed from CUDA graphs (`cuda_graphs.py`).

Cache layout: one tensor per layer for K and V, `(slots, kv_heads, max_len, head_dim)`.
A running sequence owns one slot (one row); the scheduler keeps the running rows dense
at `[0, B)` by moving rows when sequences finish (`move_rows`).

Prefill packs the prompts: linears run on the real tokens only, attention on the padded
(prompts, longest) grid, and the last layer on each prompt's last token only. Prefix
sharing: the `n` samples of a prompt are prefilled once, their KV copied into `n` rows.

Decode attention: the native kernel (`native.py`, fp32 or bf16 caches on a CPU) when
it is available, which appends the step's K/V and attends over each row's own
positions in one call; otherwise two strided batched matmuls straight on the cache
with the GQA group folded into the query axis, masked to each row's positions (fp32),
or SDPA's fused kernel (other dtypes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

import nexrl.inference.native as native
from nexrl.inference.cuda_graphs import DecodeGraphs, keep_addresses
from nexrl.inference.fused import fused_ops, torch_add_rms_norm, torch_silu_mul
from nexrl.inference.fused import rms_norm as _rms
from nexrl.inference.kernels import linear_for, weight_packer
from nexrl.inference.model_shapes import CausalLM, DecoderBlock, is_supported
from nexrl.inference.weights import cat_rows, join_rows

DEFAULT_KV_CACHE_GIB = 2.0
"""Default KV-cache budget of the built-in engine; sizes `max_model_len` when it is not set."""


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of K and V one token takes in the cache, over all layers."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * itemsize


def plan_kv_cache(
    config,
    dtype: torch.dtype,
    max_batch_size: int,
    max_model_len: int | None,
    kv_cache_gib: float | None = None,
) -> int:
    """The `max_model_len` to preallocate: `max_batch_size` rows of it fit `kv_cache_gib`.

    Unset `max_model_len` becomes the longest that fits the budget (a multiple of 16, at
    most the model's context); a set one must fit, so that a model with a long context
    (SmolLM2: 8192 positions x 128 rows = 48 GB) can never allocate the machine away.
    """
    budget_gib = DEFAULT_KV_CACHE_GIB if kv_cache_gib is None else float(kv_cache_gib)
    if budget_gib <= 0:
        raise ValueError(f"kv_cache_gib must be > 0, got {kv_cache_gib}")
    per_token = kv_bytes_per_token(config, dtype)
    context = int(config.max_position_embeddings)
    fits = int(budget_gib * 2**30) // (per_token * max_batch_size)
    if max_model_len is None:
        max_model_len = min(context, fits // 16 * 16)
        if max_model_len < 16:
            raise ValueError(
                f"kv_cache_gib={budget_gib} holds {fits} tokens per row at max_batch_size="
                f"{max_batch_size} ({per_token} bytes per token): raise kv_cache_gib or "
                "lower max_batch_size"
            )
        return max_model_len
    max_model_len = int(max_model_len)
    if max_model_len > context:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's context "
            f"(max_position_embeddings={context})"
        )
    need = per_token * max_batch_size * max_model_len
    if max_model_len > fits:
        raise ValueError(
            f"KV cache for max_batch_size={max_batch_size} x max_model_len={max_model_len} "
            f"needs {need / 2**30:.2f} GiB > kv_cache_gib={budget_gib}: lower max_model_len "
            f"(at most {fits} fits) or max_batch_size, or raise kv_cache_gib"
        )
    return max_model_len


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


@dataclass
class _Plan:
    """Index plan of one prefill: R prompts of `lengths`, packed into T tokens."""

    lengths: torch.Tensor  # (R,)
    grid: torch.Tensor  # (T,) index of each token in the flattened (R, P) padded grid
    pos: torch.Tensor  # (T,) position of each token in its prompt
    last: torch.Tensor  # (R,) packed index of each prompt's last token
    cache_from: torch.Tensor  # (M * kv,) row of the packed (T * kv, D) K/V to copy ...
    cache_to: torch.Tensor  # (M * kv,) ... into this row of the flat (slots*kv*len, D) cache

    @staticmethod
    def build(lengths, src, dst, width: int, n_kv: int, max_len: int, start=None) -> _Plan:
        """`start` (R,): positions already in the cache rows of each prompt (a cached
        prefix); the R prompts' `lengths` tokens then go to positions `start + i`."""

        def ragged_arange(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """(which segment, index within it) of every element of segments `counts`."""
            seg = torch.repeat_interleave(torch.arange(len(counts)), counts)
            starts = torch.cumsum(counts, 0) - counts
            return seg, torch.arange(int(counts.sum())) - starts[seg]

        start = torch.zeros_like(lengths) if start is None else start
        offsets = torch.cumsum(lengths, 0) - lengths  # packed start of each prompt
        row, pos = ragged_arange(lengths)
        j, cache_pos = ragged_arange(lengths[src])  # every (cache row, position) to fill
        token = offsets[src][j] + cache_pos
        cache_pos = cache_pos + start[src][j]
        heads = torch.arange(n_kv)
        return _Plan(
            lengths=lengths,
            grid=row * width + pos,
            pos=pos + start[row],
            last=offsets + lengths - 1,
            cache_from=(token[:, None] * n_kv + heads).flatten(),
            cache_to=((dst[j][:, None] * n_kv + heads) * max_len + cache_pos[:, None]).flatten(),
        )

    def to(self, device: torch.device) -> _Plan:
        return _Plan(*(getattr(self, f.name).to(device) for f in fields(self)))

    def pad(self, t: torch.Tensor, r: int, p: int) -> torch.Tensor:
        """Packed (T, heads, D) -> zero-padded (R, heads, P, D)."""
        out = t.new_zeros(r * p, *t.shape[1:]).index_copy_(0, self.grid, t)
        return out.view(r, p, *t.shape[1:]).transpose(1, 2)

    def key_mask(self, r: int, p: int) -> torch.Tensor:
        """(R, 1, 1, P) True on each prompt's real positions."""
        keys = torch.arange(p, device=self.lengths.device)
        return (keys[None] < self.lengths[:, None]).view(r, 1, 1, p)


@dataclass
class _Cached:
    """Attention of a prefill whose prompts continue a cached prefix: keys and values
    are read from one cache row of each prompt, over positions [0, span)."""

    rows: torch.Tensor  # (R,) a cache row of each prompt
    span: int
    causal: torch.Tensor  # (R, 1, P, span): query i of prompt r sees keys <= start[r] + i
    key_mask: torch.Tensor  # (R, 1, 1, span): the prompt's positions

    @staticmethod
    def of(start, lengths, src, dst, width: int, device: torch.device) -> _Cached:
        rows = torch.empty_like(start)
        rows[src] = dst  # a row of each prompt (all of them hold the same positions)
        total = start + lengths
        span = int(total.max())
        keys = torch.arange(span)
        query_pos = start[:, None] + torch.arange(width)  # (R, P)
        return _Cached(
            rows=rows.to(device),
            span=span,
            causal=(keys <= query_pos[:, :, None])[:, None].to(device),
            key_mask=(keys < total[:, None])[:, None, None].to(device),
        )

    def keys(self, cache: torch.Tensor) -> torch.Tensor:
        return cache[self.rows, :, : self.span]  # (R, kv, span, D)


def _layer(block: DecoderBlock, pack: Callable[[torch.Tensor], torch.Tensor]) -> _Layer:
    attn, mlp = block.self_attn, block.mlp
    qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return _Layer(
        ln1=block.input_layernorm.weight,
        qkv_w=pack(join_rows(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)),
        qkv_b=cat_rows(attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias),
        o_w=pack(attn.o_proj.weight),
        o_b=attn.o_proj.bias,
        q_norm=qn.weight if qn is not None else None,
        k_norm=kn.weight if kn is not None else None,
        ln2=block.post_attention_layernorm.weight,
        gate_up_w=pack(join_rows(mlp.gate_proj.weight, mlp.up_proj.weight)),
        gate_up_b=cat_rows(mlp.gate_proj.bias, mlp.up_proj.bias),
        down_w=pack(mlp.down_proj.weight),
        down_b=mlp.down_proj.bias,
    )


def _weights(lm_head: torch.Tensor, layers: list[_Layer]) -> list[torch.Tensor | None]:
    return [lm_head] + [getattr(layer, f.name) for layer in layers for f in fields(layer)]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE: x * cos + rotate_half(x) * sin, with rotate_half folded into roll + signed sin."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


class ModelRunner:
    """Owns the cache and runs prefill / decode forwards. Not thread-safe: one owner thread."""

    def __init__(
        self,
        model: CausalLM,
        max_slots: int,
        max_len: int,
        matmul: str = "auto",
        native_attention: bool = True,
        cuda_graphs: bool = True,
    ) -> None:
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
        self.linear = linear_for(self.device, self.dtype, matmul)
        self._pack = weight_packer(self.device, self.dtype, matmul)
        shape = (max_slots, self.n_kv, max_len, self.head_dim)
        n_layers = cfg.num_hidden_layers
        self.k_cache = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(n_layers)
        ]
        self.v_cache = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(n_layers)
        ]
        slots = torch.arange(max_slots, device=self.device)[:, None] * self.n_kv
        self._row_base = (slots + torch.arange(self.n_kv, device=self.device)) * max_len
        on_cpu = self.device.type == "cpu"
        self.native_attention = (
            native.decode_attention(self.head_dim, max_len, self.dtype)
            if native_attention and on_cpu
            else None
        )
        # the decode step's residual adds, norms and SiLU in C (same switch as attention)
        self.fused = fused_ops(self.dtype) if native_attention and on_cpu else None
        self._rope_table(max_len)
        self.graphs: DecodeGraphs | None = None
        self.refresh()
        # RoPE at decode runs in torch unless the native kernel does it for every layer
        # (it does when there is no q/k norm between projection and rotation)
        self._torch_rope = self.native_attention is None or any(
            layer.q_norm is not None for layer in self.layers
        )
        if cuda_graphs and self.device.type == "cuda":  # last: recording runs the decode step
            vocab = model.lm_head.weight.shape[0]
            self.graphs = DecodeGraphs(self._decode, max_slots, max_len, vocab, self.device)

    @torch.inference_mode()
    def _rope_table(self, max_len: int) -> None:
        pos = torch.arange(max_len, device=self.device)[None]
        dummy = torch.zeros(1, dtype=torch.float32, device=self.device)
        cos, sin = self.model.model.rotary_emb(dummy, pos)  # (1, L, D) each
        half = cos.shape[-1] // 2
        sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(sin.device)
        self.cos = cos[0].to(self.dtype).contiguous()  # (L, D)
        self.sin = (sin[0] * sign).to(self.dtype).contiguous()

    @torch.inference_mode()
    def refresh(self) -> None:
        """Rebuild the fused weights from the model's parameters (after a weight update).
        With CUDA graphs the new weights are copied into the tensors the graphs read."""
        inner = self.model.model
        lm_head = self._pack(self.model.lm_head.weight)
        layers = [_layer(block, self._pack) for block in inner.layers]
        if self.graphs is not None:
            keep_addresses(self._weights(), _weights(lm_head, layers))
            return
        self.embed = inner.embed_tokens.weight
        self.final_norm = inner.norm.weight
        self.lm_head, self.layers = lm_head, layers

    def _weights(self) -> list[torch.Tensor | None]:
        """The weights the decode forward reads (the model's own norms and embedding are
        updated in place by a weight update)."""
        return _weights(self.lm_head, self.layers)

    # -- cache bookkeeping ------------------------------------------------------------------
    def move_rows(self, src: torch.Tensor, dst: torch.Tensor, span: int | None = None) -> None:
        """Copy cache rows `src` to rows `dst` (both (M,) long), positions [0, span) only
        (None: all of them)."""
        span = span or self.k_cache[0].shape[2]
        for k, v in zip(self.k_cache, self.v_cache, strict=True):
            k[dst, :, :span] = k[src, :, :span]
            v[dst, :, :span] = v[src, :, :span]

    # -- forwards ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        src: torch.Tensor,
        dst: torch.Tensor,
        start: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run prompts and fill the cache; returns last-position logits (R, V) float.

        tokens (R, P) right-padded prompts, lengths (R,); prompt `src[i]` is copied into
        cache row `dst[i]` (a prompt with n samples appears n times in `src`). With
        `start` (R,), every cache row of prompt i already holds its first `start[i]`
        positions (a cached prefix) and `tokens` are the rest of the prompt.

        The linears run on the T real tokens only (no padding); only attention sees the
        padded (R, P) grid. The last layer needs its output at each prompt's last token
        only, so its attention, o-projection and MLP run on R rows.
        """
        r, p = tokens.shape
        plan = _Plan.build(lengths, src, dst, p, self.n_kv, self.max_len, start).to(self.device)
        cached = None
        if start is not None and bool(start.any()):
            cached = _Cached.of(start, lengths, src, dst, p, self.device)
        tokens = tokens.to(self.device)
        cos, sin = self.cos[plan.pos][:, None], self.sin[plan.pos][:, None]  # (T, 1, D)
        x = F.embedding(tokens.reshape(-1)[plan.grid], self.embed)  # (T, H)
        x, h = self._add_norm(x, None, self.layers[0].ln1)
        last_layer = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            q, k, v = self._decode_qkv(layer, h, cos, sin)
            self._write_prompt_kv(i, plan, k, v)
            if cached is None:
                kp, vp = plan.pad(k, r, p), plan.pad(v, r, p)  # (R, kv, P, D)
                causal, keys = None, plan.key_mask(r, p)
            else:  # the prefix is in the cache: keys and values come from there
                kp, vp = cached.keys(self.k_cache[i]), cached.keys(self.v_cache[i])
                causal, keys = cached.causal, cached.key_mask
            if i < last_layer:
                att = F.scaled_dot_product_attention(
                    plan.pad(q, r, p),
                    kp,
                    vp,
                    attn_mask=causal,
                    is_causal=causal is None,
                    enable_gqa=True,
                )  # (R, heads, P, D)
                att = att.transpose(1, 2).reshape(r * p, -1).index_select(0, plan.grid)
            else:
                q_last = q.index_select(0, plan.last)[:, :, None]  # (R, heads, 1, D)
                att = F.scaled_dot_product_attention(
                    q_last, kp, vp, attn_mask=keys, enable_gqa=True
                ).reshape(r, -1)
                x = x.index_select(0, plan.last)
            x, h = self._mlp(i, x, self.linear(att, layer.o_w, layer.o_b))
        return self.linear(h, self.lm_head, None).float()

    def _write_prompt_kv(self, layer: int, plan: _Plan, k: torch.Tensor, v: torch.Tensor) -> None:
        d = self.head_dim
        for cache, new in ((self.k_cache[layer], k), (self.v_cache[layer], v)):
            rows = new.reshape(-1, d).index_select(0, plan.cache_from)
            cache.view(-1, d).index_copy_(0, plan.cache_to, rows)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, pos: torch.Tensor, span: int | None = None):
        """One step for rows [0, B): tokens (B,) at positions pos (B,); returns logits (B, V).
        `span` (> every pos, optional) saves reading `pos` back from the device."""
        if self.graphs is not None:
            return self.graphs(tokens, pos, span or int(pos.max()) + 1)
        return self._decode(tokens, pos, span)

    def _decode(self, tokens: torch.Tensor, pos: torch.Tensor, span: int | None) -> torch.Tensor:
        b, kv, d = tokens.shape[0], self.n_kv, self.head_dim
        if self._torch_rope:
            cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # (B, 1, D)
        if self.native_attention is None:  # torch path: cache index, keys attended, mask
            flat = (self._row_base[:b] + pos[:, None]).flatten()
            width = span or int(pos.max()) + 1
            bias = self._decode_bias(pos, width)
        x = F.embedding(tokens, self.embed)  # (B, H), a new tensor (updated in place below)
        x, h = self._add_norm(x, None, self.layers[0].ln1)
        for i, layer in enumerate(self.layers):
            kc, vc = self.k_cache[i], self.v_cache[i]
            if self.native_attention is not None and layer.q_norm is None:
                att = self._native_step(self.native_attention, layer, h, kc, vc, pos)  # +RoPE
            elif self.native_attention is not None:  # appends k, v to the cache itself
                q, k, v = self._decode_qkv(layer, h, cos, sin)
                att = self.native_attention(q, k, v, kc, vc, pos)
            else:
                q, k, v = self._decode_qkv(layer, h, cos, sin)
                kc.view(-1, d).index_copy_(0, flat, k.reshape(b * kv, d))
                vc.view(-1, d).index_copy_(0, flat, v.reshape(b * kv, d))
                att = self._decode_attention(q, kc, vc, bias, b, width)
            x, h = self._mlp(i, x, self.linear(att.reshape(b, -1), layer.o_w, layer.o_b))
        return self.linear(h, self.lm_head, None).float()

    def _mlp(self, i: int, x: torch.Tensor, attended: torch.Tensor):
        """Layer i after its attention: the residual add, the MLP and its residual add;
        returns (x, x normed for what comes next: layer i + 1, or the LM head)."""
        layer = self.layers[i]
        x, h = self._add_norm(x, attended, layer.ln2)
        act = self._silu_mul(self.linear(h, layer.gate_up_w, layer.gate_up_b))
        last = i + 1 == len(self.layers)
        norm = self.final_norm if last else self.layers[i + 1].ln1
        return self._add_norm(x, self.linear(act, layer.down_w, layer.down_b), norm)

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor):
        """(x + delta, RMSNorm of it with weight w): the residual connection and the next
        norm. With the fused C ops x is updated in place (the forward owns it)."""
        if self.fused is not None:
            return x, self.fused.add_rms_norm(x, delta, w, self.eps)
        return torch_add_rms_norm(x, delta, w, self.eps)

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.silu_mul(gate_up)
        return torch_silu_mul(gate_up)

    def _native_step(
        self, attend: native.AttentionFn, layer: _Layer, h, kc, vc, pos
    ) -> torch.Tensor:
        """q/k/v projection, then RoPE, cache append and attention in one native call."""
        nh, kv = self.n_heads, self.n_kv
        qkv = self.linear(h, layer.qkv_w, layer.qkv_b).view(h.shape[0], nh + 2 * kv, -1)
        q, k, v = qkv[:, :nh], qkv[:, nh : nh + kv], qkv[:, nh + kv :]
        return attend(q, k, v, kc, vc, pos, (self.cos, self.sin))

    def _decode_bias(self, pos: torch.Tensor, span: int) -> torch.Tensor:
        """The torch attention path's mask over each row's first `span` positions: additive
        (B, 1, span), -1e30 past the row's pos, for the fp32 bmm path; boolean (B, 1, 1,
        span), True up to pos, for the SDPA path of other dtypes."""
        hidden = torch.arange(span, device=pos.device)[None] > pos[:, None]
        if self.dtype != torch.float32:
            return ~hidden[:, None, None]
        return torch.zeros(pos.shape[0], 1, span, dtype=self.dtype, device=pos.device).masked_fill_(
            hidden[:, None], -1e30
        )

    def _decode_qkv(self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h (B, H) -> q (B, heads, D), k and v (B, kv_heads, D); RoPE on q and k in one go."""
        nh, kv, d = self.n_heads, self.n_kv, self.head_dim
        qkv = self.linear(h, layer.qkv_w, layer.qkv_b).view(h.shape[0], nh + 2 * kv, d)
        v = qkv[:, nh + kv :]
        if layer.q_norm is None or layer.k_norm is None:
            qk = _rotate(qkv[:, : nh + kv], cos, sin)
            return qk[:, :nh], qk[:, nh:], v
        q = _rotate(_rms(qkv[:, :nh], layer.q_norm, self.eps), cos, sin)
        k = _rotate(_rms(qkv[:, nh : nh + kv], layer.k_norm, self.eps), cos, sin)
        return q, k, v

    def _decode_attention(self, q, kc, vc, bias, b: int, span: int) -> torch.Tensor:
        """q (B, heads, D) against cache rows [0, B) up to `span`; the result reshapes to
        (B, heads * D): (B*kv, group, D) on the fp32 path, (B, heads, 1, D) on SDPA's.

        fp32: the GQA group goes on the query axis and the cache is viewed as (slots*kv,
        len, D), so both matmuls are strided batched GEMMs over the cache without copies.
        Other dtypes go through SDPA's fused CPU kernel (fp32 accumulation, the cache read
        in place): SmolLM2's bf16 decode step at 64 rows 83 -> 70 ms on one thread, a few
        percent slower than two bmms on two threads (docs/performance.md).
        """
        if self.dtype != torch.float32:
            return F.scaled_dot_product_attention(
                q[:, :, None], kc[:b, :, :span], vc[:b, :, :span], attn_mask=bias, enable_gqa=True
            )
        d, group = self.head_dim, self.n_heads // self.n_kv
        q = q.reshape(b * self.n_kv, group, d)
        k = kc.view(-1, self.max_len, d)[: b * self.n_kv, :span]  # (B*kv, L, D)
        v = vc.view(-1, self.max_len, d)[: b * self.n_kv, :span]
        scores = torch.bmm(q, k.transpose(1, 2)).view(b, self.n_heads, span)
        probs = torch.softmax(scores * d**-0.5 + bias, dim=-1)
        return torch.bmm(probs.view(b * self.n_kv, group, span), v)
