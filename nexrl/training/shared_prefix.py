"""Shared-prefix forward: run each distinct prompt once, then only the responses.

In GRPO a train batch holds `group_size` rows per prompt. Under causal attention a
prompt's hidden states (and its key/value cache) do not depend on what follows, so
for rows that start with the same tokens the model can run those tokens once:

1. prefix forward: the distinct prefixes (right padded) with `use_cache=True`;
2. the cache is indexed by each row's prefix id, (P, heads, Lp, d) -> (b, heads, Lp, d);
3. suffix forward: each row's remaining tokens on top of its expanded cache, with
   `position_ids` continuing from the prefix length and the prefix's padding masked.
   Rows are right padded to the longest suffix; when a few long suffixes (a multi-turn
   episode beside one-turn ones) would make most of that padding, the rows go in two
   forwards by suffix length (`split_suffixes`).

   Or, on a CPU with short responses (`group_suffixes`), one sequence per prefix: its
   rows' suffixes one after the other on the prefix's own cache, each seeing the prefix
   and itself only (a 4D mask). The attention then runs per prefix instead of per row,
   and the CPU attention kernel's cost per (row, head) was most of the attention's time
   on the default task (`GROUP_MAX_TOKENS`).

Autograd flows through the index into the single prefix forward, so the loss and the
gradients are those of the plain forward (up to float summation order).

A row's prefix is everything before its first wanted position (`select`, the loss
mask in training); the logprob of that first token comes from the prefix's last
hidden state. The suffix stops before the row's last wanted token, whose own hidden
state predicts nothing wanted. Only wanted positions are projected onto the
vocabulary (`project_rows`, chunked like `chunked_token_logprobs`), so the output
projection never sees the prompt. Padded layout only (right padding); the engine
decides where this path is allowed (`TorchTrainEngine._shared_prefix_allowed`).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin

from nexrl.training.masks import full_attention, model_attention_mask
from nexrl.training.microbatch import project_rows


@dataclass
class PrefixPlan:
    """How a micro-batch's rows split into shared prefixes and per-row suffixes."""

    prefix_ids: torch.Tensor  # (P, Lp) distinct prefixes, right padded
    prefix_mask: torch.Tensor  # (P, Lp)
    row_prefix: torch.Tensor  # (b,) index of each row's prefix
    start: torch.Tensor  # (b,) prefix length = first wanted position of the row
    suffix_ids: torch.Tensor  # (b, S) tokens start .. last wanted - 1, right padded
    suffix_mask: torch.Tensor  # (b, S)
    want: torch.Tensor  # (b, T) bool: grid positions whose logprob is computed
    buckets: list[torch.Tensor]  # row indices of each suffix forward (ascending)
    offsets: torch.Tensor  # (b,) where the row's suffix starts in its prefix's sequence
    group_width: int  # tokens of the longest prefix's suffixes together
    grouped: bool = False  # one suffix sequence per prefix (`group_suffixes`)

    @property
    def model_tokens(self) -> int:
        """Real tokens the forwards run (the plain path runs every real token)."""
        return int(self.prefix_mask.sum()) + int(self.suffix_mask.sum())

    @property
    def padded_tokens(self) -> int:
        """Tokens the forwards compute, padding included (compare `want` width x rows)."""
        if self.grouped:
            return self.prefix_mask.numel() + len(self.prefix_ids) * self.group_width
        lengths = self.suffix_mask.sum(-1)
        suffixes = sum(len(rows) * int(lengths[rows].max()) for rows in self.buckets)
        return self.prefix_mask.numel() + suffixes


def plan_prefixes(
    input_ids: torch.Tensor,  # (b, T) right padded
    attention_mask: torch.Tensor,  # (b, T)
    select: torch.Tensor,  # (b, T) positions whose logprob is wanted
    split_suffixes: bool = True,
    group_suffixes: bool = False,
) -> PrefixPlan | None:
    """The plan, or None when no prefix is shared by two rows (or rows are not right
    padded): then the plain forward is as cheap. `split_suffixes`: allow two suffix
    forwards where that saves `SPLIT_MIN_SAVING` of the suffixes' padded tokens.
    `group_suffixes`: one suffix sequence per prefix where the longest has at most
    `GROUP_MAX_TOKENS` (the forward then needs a 4D mask: `dense_masks`)."""
    real = attention_mask.bool()
    lengths = real.sum(-1)  # (b,)
    cols = torch.arange(real.shape[1], device=real.device)
    if not torch.equal(real, cols < lengths[:, None]) or bool((lengths == 0).any()):
        return None
    want = select.bool() & real
    want[:, 0] = False  # the first token has no prediction
    has_want = want.any(-1)
    start = torch.where(has_want, want.int().argmax(-1), torch.ones_like(lengths))
    last = torch.where(has_want, (want * cols).argmax(-1), start)  # last wanted position
    keys: dict[tuple[int, ...], int] = {}
    rows = input_ids.tolist()  # one conversion: slicing 256 tensor rows took 2 ms
    row_prefix = [
        keys.setdefault(tuple(ids[:n]), len(keys))
        for ids, n in zip(rows, start.tolist(), strict=True)
    ]
    if len(keys) == len(row_prefix):
        return None
    prefix_ids, prefix_mask = _right_pad([list(k) for k in keys], input_ids)
    suffix_len = last - start  # (b,) tokens start .. last - 1
    span = torch.arange(int(suffix_len.max()), device=real.device)
    suffix_mask = (span < suffix_len[:, None]).long()
    index = (start[:, None] + span).clamp(max=real.shape[1] - 1)
    offsets, group_width = _offsets_in_groups(row_prefix, suffix_len.tolist(), len(keys))
    return PrefixPlan(
        prefix_ids=prefix_ids,
        prefix_mask=prefix_mask,
        row_prefix=torch.tensor(row_prefix, device=real.device),
        start=start,
        suffix_ids=input_ids.gather(1, index) * suffix_mask,
        suffix_mask=suffix_mask,
        want=want,
        buckets=_length_buckets(suffix_len) if split_suffixes else [torch.arange(len(rows))],
        offsets=torch.tensor(offsets, device=real.device),
        group_width=group_width,
        grouped=group_suffixes and group_width <= GROUP_MAX_TOKENS,
    )


GROUP_MAX_TOKENS = 256
"""The longest prefix's suffixes together up to which they run as one sequence per prefix
(`group_suffixes`). Its attention grows with that length squared, against a fixed cost
per (row, head) of the per-row layout. Tiny model, 16 prefixes x 16 rows, 2 threads,
Zen 4 (forward and backward, grouped / per row): 0.71 at 64 tokens, 0.80 at 128, 0.88
at 256, 1.06 at 512, 2.0 at 2048."""


def _offsets_in_groups(row_prefix: list[int], lengths: list[int], n: int) -> tuple[list[int], int]:
    """Each row's offset in its prefix's suffix sequence (rows in order), and the longest
    sequence."""
    used = [0] * n
    offsets = []
    for prefix, length in zip(row_prefix, lengths, strict=True):
        offsets.append(used[prefix])
        used[prefix] += length
    return offsets, max(used)


SPLIT_MIN_SAVING = 0.25
"""Two suffix forwards only where they compute this fraction fewer suffix tokens than one."""


def _length_buckets(lengths: torch.Tensor) -> list[torch.Tensor]:
    """All rows, or the rows in two groups by length (the cut that pads least)."""
    n = len(lengths)
    everything = [torch.arange(n, device=lengths.device)]
    if n < 2:
        return everything
    order = lengths.argsort()
    ranked = lengths[order]
    first = torch.arange(1, n, device=lengths.device)  # rows in the short group
    padded = ranked[first - 1] * first + ranked[-1] * (n - first)
    cut = int(padded.argmin())
    whole = int(ranked[-1]) * n
    if whole - int(padded[cut]) < SPLIT_MIN_SAVING * whole:
        return everything
    return [order[: cut + 1].sort().values, order[cut + 1 :].sort().values]


def shared_prefix_logprobs(
    module: torch.nn.Module,  # the model with its head replaced by an identity
    head: torch.Tensor,  # (V, H) output projection
    input_ids: torch.Tensor,  # (b, T)
    plan: PrefixPlan,
    with_entropy: bool = False,
    chunk_tokens: int = 1024,
    dense_masks: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(b, T) logprobs (and entropy) at `plan.want`, 0 elsewhere: the layout of
    `chunked_token_logprobs` with the same `select`. Differentiable. `dense_masks`:
    pass 4D masks built here (`nexrl.training.masks`)."""
    if plan.grouped and not dense_masks:
        raise ValueError("a grouped plan (group_suffixes) needs 4D masks: dense_masks=True")
    cache = DynamicCache()
    width = plan.prefix_ids.shape[1]
    positions = torch.arange(width, device=input_ids.device).expand_as(plan.prefix_ids)
    out = module(
        input_ids=plan.prefix_ids,
        attention_mask=model_attention_mask(plan.prefix_mask, width, dense_masks),
        position_ids=positions,
        **_cache_arg(module, cache),
        use_cache=True,
    )
    lengths = plan.prefix_mask.sum(-1)
    last = out.logits[torch.arange(len(lengths)), lengths - 1]  # (P, H) predicts token `start`
    if plan.grouped:
        hidden = _grouped_suffix_hidden(module, plan, cache, last)
    else:
        hidden = _row_suffix_hidden(module, plan, cache, last, dense_masks)
    # hidden: (b, 1 + S, H), [:, k] predicts token start + k
    cols = plan.start[:, None] + torch.arange(hidden.shape[1], device=input_ids.device)
    inside = cols < input_ids.shape[1]
    cols = cols.clamp(max=input_ids.shape[1] - 1)
    wanted = plan.want.gather(1, cols) & inside  # (b, 1 + S)
    lp, ent = project_rows(
        hidden[wanted], head, input_ids.gather(1, cols)[wanted], with_entropy, chunk_tokens
    )
    # row-major order of `wanted` (r, k) is that of `want` (r, start_r + k)
    lp_grid = lp.new_zeros(plan.want.shape).masked_scatter(plan.want, lp)
    if not with_entropy:
        return lp_grid, None
    return lp_grid, ent.new_zeros(plan.want.shape).masked_scatter(plan.want, ent)


def _row_suffix_hidden(module, plan: PrefixPlan, cache, last, dense_masks: bool) -> torch.Tensor:
    """The suffix forwards of `plan.buckets`, each row on its own copy of its prefix's
    cache."""
    width = plan.suffix_ids.shape[1]
    parts = [_suffix_hidden(module, plan, rows, cache, last, dense_masks) for rows in plan.buckets]
    parts = [torch.nn.functional.pad(h, (0, 0, 0, 1 + width - h.shape[1])) for h in parts]
    return torch.cat(parts)[torch.cat(plan.buckets).argsort()]


def _grouped_suffix_hidden(module, plan: PrefixPlan, cache, last) -> torch.Tensor:
    """One forward of a sequence per prefix: its rows' suffixes back to back on the
    prefix's cache (`plan.offsets`), each seeing the prefix and its own earlier tokens."""
    hidden = last[plan.row_prefix][:, None]  # (b, 1, H)
    if plan.group_width == 0:
        return hidden
    real = plan.suffix_mask.bool()  # (b, S)
    span = torch.arange(real.shape[1], device=real.device)
    cols = plan.offsets[:, None] + span
    groups = plan.row_prefix[:, None].expand_as(cols)
    shape = (len(plan.prefix_ids), plan.group_width)
    where = (groups[real], cols[real])
    ids = plan.suffix_ids.new_zeros(shape).index_put_(where, plan.suffix_ids[real])
    positions = (plan.start[:, None] + span).expand_as(cols)[real]
    position_ids = cols.new_zeros(shape).index_put_(where, positions)
    rows = torch.arange(len(real), device=real.device)[:, None].expand_as(cols)
    owner = cols.new_full(shape, -1).index_put_(where, rows[real])
    out = module(
        input_ids=ids,
        attention_mask=grouped_suffix_mask(plan.prefix_mask, owner),
        position_ids=position_ids,
        **_cache_arg(module, cache),
        use_cache=True,
    ).logits  # (P, W, H)
    return torch.cat([hidden, out[groups, cols.clamp(max=shape[1] - 1)]], 1)


def grouped_suffix_mask(prefix_mask: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """(P, 1, W, Lp + W) bool: a query of prefix p's sequence sees p's real prefix keys
    and the earlier keys of its own row (`owner` (P, W): the row of each position, -1 for
    padding); a padding query sees itself too (a finite output that nothing reads)."""
    width = owner.shape[1]
    q = torch.arange(width, device=owner.device)
    own = (owner[:, :, None] == owner[:, None, :]) & (q[None, None, :] <= q[None, :, None])
    own = (own & (owner >= 0)[:, :, None]) | (q[:, None] == q[None])[None]
    prefix = prefix_mask.bool()[:, None, :].expand(-1, width, -1)
    return torch.cat([prefix, own], -1)[:, None]


def _suffix_hidden(
    module: torch.nn.Module,
    plan: PrefixPlan,
    rows: torch.Tensor,
    cache: DynamicCache,
    last: torch.Tensor,
    dense_masks: bool,
) -> torch.Tensor:
    """(r, 1 + S_r, H): the prefix's last hidden state, then the suffix forward of `rows`
    on their prefixes' cache, S_r the longest suffix among them."""
    prefix = plan.row_prefix[rows]
    hidden = last[prefix][:, None]
    width = int(plan.suffix_mask[rows].sum(-1).max())
    if width == 0:
        return hidden
    suffix_mask = plan.suffix_mask[rows, :width]
    span = torch.arange(width, device=rows.device)
    keys = torch.cat([plan.prefix_mask[prefix], suffix_mask], 1)
    suffix = module(
        input_ids=plan.suffix_ids[rows, :width],
        attention_mask=model_attention_mask(keys, width, dense_masks),
        position_ids=plan.start[rows, None] + span,
        **_cache_arg(module, _select_rows(cache, prefix)),
        use_cache=True,
    ).logits
    return torch.cat([hidden, suffix], 1)


def _select_rows(cache: DynamicCache, index: torch.Tensor) -> DynamicCache:
    """A new cache holding `cache`'s entries for batch rows `index` (autograd-tracked; the
    prefix cache stays as it is for the next group of rows)."""
    out = DynamicCache()
    for i, layer in enumerate(cache.layers):
        # a linear-attention layer (transformers 5) is no key/value cache to slice;
        # supports_prefix_cache keeps such models off this path
        if not isinstance(layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
            raise ValueError(f"prefix KV cache layer {i} holds no keys/values to share")
        out.update(layer.keys[index], layer.values[index], i)
    return out


def _cache_arg(module: torch.nn.Module, cache: DynamicCache) -> dict[str, DynamicCache]:
    """`cache` as the keyword argument `module.forward` takes it under."""
    name = _cache_kwarg(module)
    if name is None:
        raise ValueError(
            f"{type(module).__name__}.forward takes no KV cache: shared-prefix logprobs need "
            "one (supports_prefix_cache)"
        )
    return {name: cache}


def supports_prefix_cache(model: torch.nn.Module) -> bool:
    """The model's forward takes a KV cache and position ids, and every layer attends to
    the whole past (a sliding window would see a different past through a cache)."""
    return _cache_kwarg(model) is not None and full_attention(model.config)


def _cache_kwarg(model: torch.nn.Module) -> str | None:
    """The name of the KV-cache argument of `model.forward` (transformers 5 renamed
    `past_key_values` to `cache`), or None when it takes no cache and position ids. A peft
    wrapper passes the argument on to its base model, which names it."""
    base = getattr(model, "get_base_model", None)
    model = base() if base is not None else model
    return _forward_cache_kwarg(getattr(model.forward, "__func__", model.forward))


@functools.lru_cache(maxsize=64)
def _forward_cache_kwarg(forward) -> str | None:
    params = inspect.signature(forward).parameters  # ~0.1 ms: once per forward function
    if "position_ids" not in params:
        return None
    return next((n for n in ("cache", "past_key_values") if n in params), None)


def _right_pad(rows: list[list[int]], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=like.dtype)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=like.dtype)
        mask[i, : len(r)] = 1
    return ids.to(like.device), mask.to(like.device)
