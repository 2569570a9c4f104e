"""Automatic prefix caching: prompt KV kept across requests and found by its tokens.

Prompts that start with the same tokens (a chat template's system prompt, the earlier
turns of a multi-turn conversation, a task's shared instructions) have the same keys
and values at those positions. The engine keeps the KV of the prompts it prefilled in
a token trie; an admitted prompt's longest cached prefix is copied into its cache rows
and only the rest of it runs through the model.

Store: per layer one K and one V tensor of `capacity` token slots, `(capacity, kv,
head_dim)`, views of one block allocated empty (pages are touched as slots fill) and
allocated anew at a clear. Trie: a cached token
is a slot, its node; one dict maps (parent slot, token) to the child's slot, and flat
lists hold each slot's parent, token, child count and last use, so caching a token
allocates no Python object (the engine caches every prompt and sample: with an object
and a dict per token the default run's rollout side took 13 ms a step longer, with
these lists no longer than without a cache). Eviction takes least-recently-used
leaves, so the whole prefix of a cached token is always cached too. The KV depends on
the weights: a weight update clears the cache. A finished sample's insert starts where
its prompt's ended (`Anchor`), so it walks its new tokens only.

Prompts admitted together that share a prefix none of them has cached (64 chats with
one system prompt) are split into two prefill waves by `split_waves`: one prompt per
shared prefix first, then the others, which find it cached.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple

import torch

from nexrl.inference.sampler import to_device

MAX_CACHED_TOKENS = 65536
"""Upper bound of the trie's size whatever the budget (its bookkeeping is Python lists)."""

MIN_SHARED_TOKENS = 16
"""Tokens a prompt must share with another of its wave (beyond what is cached) for the
wave to be split in two (a second prefill forward has a fixed cost)."""

_ROOT = -1


class Anchor(NamedTuple):
    """Where an inserted sequence's cached path ends: its first `depth` tokens are cached,
    the last at `slot` (the root, -1, for none). Valid in its `epoch` only: an eviction
    or a clear may reuse the slot."""

    epoch: int
    slot: int
    depth: int


def _key(parent: int, token: int) -> int:
    """The child dict's key of `token` under slot `parent` (the root is -1)."""
    return ((parent + 1) << 32) | token


class PrefixCache:
    """KV of cached prompt tokens in a token trie; used by one engine thread only."""

    def __init__(
        self,
        n_layers: int,
        n_kv: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"prefix cache capacity must be >= 1 token, got {capacity}")
        self._size = (2, n_layers, capacity, n_kv, head_dim)
        self._dtype, self._device = dtype, device
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._fresh = 0
        self.capacity, self.n_kv = capacity, n_kv
        self._parent, self._token = [0] * capacity, [0] * capacity
        self._children, self._used = [0] * capacity, [0] * capacity
        self.stats = {"cached_tokens": 0, "evicted_tokens": 0}  # hits: the engine counts them
        self._epoch = 0  # +1 at every clear and eviction: an `Anchor` is valid in its epoch
        self.clear()

    @classmethod
    def for_runner(cls, runner, gib: float) -> PrefixCache | None:
        """A cache of `gib` GiB beside `runner`'s KV cache (at most `MAX_CACHED_TOKENS`
        tokens); None when `gib` is 0."""
        gib = float(gib)
        if gib < 0:
            raise ValueError(f"engine option prefix_cache_gib must be >= 0, got {gib}")
        if gib == 0:
            return None
        k = runner.k_cache[0]
        per_token = 2 * len(runner.k_cache) * runner.n_kv * runner.head_dim * k.element_size()
        capacity = min(int(gib * 2**30) // per_token, MAX_CACHED_TOKENS)
        if capacity < 1:
            raise ValueError(
                f"prefix_cache_gib={gib} holds no token ({per_token} bytes per token): raise it "
                "or set 0 to turn the prefix cache off"
            )
        return cls(len(runner.k_cache), runner.n_kv, runner.head_dim, capacity, k.dtype, k.device)

    def clear(self) -> None:
        """Forget every cached token (after a weight update). The store is one allocation,
        made anew once a slot was written: the pages the old one held go back to the OS
        (a CPU allocator maps a block this large on its own) and the new one's are touched
        as slots fill: the engine holds what it cached since the last update, not the
        most it ever cached (in a sync run, the trainer's update runs beside it)."""
        if not self.k or self._fresh:
            store = torch.empty(self._size, dtype=self._dtype, device=self._device)
            self.k, self.v = list(store[0]), list(store[1])
        self._child: dict[int, int] = {}  # _key(parent slot, token) -> slot
        self._free: list[int] = []  # evicted slots
        self._fresh = 0  # slots [fresh, capacity) were never used since the last clear
        self._clock = 0
        self._epoch += 1  # anchors made before are void
        self.stats["cached_tokens"] = 0

    # -- lookup -----------------------------------------------------------------------------
    def cached_length(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` are cached (at most all but the last)."""
        return len(self._path(tokens))

    def match(self, tokens: Sequence[int]) -> list[int]:
        """Slots of the longest cached prefix of `tokens`, leaving at least the last token
        to compute (its logits sample the first output token); marks them used."""
        self._clock += 1
        slots = self._path(tokens)
        for slot in slots:
            self._used[slot] = self._clock
        return slots

    def _path(self, tokens: Sequence[int]) -> list[int]:
        node, slots, child = _ROOT, [], self._child
        for t in tokens[: len(tokens) - 1]:
            found = child.get(_key(node, t))
            if found is None:
                break
            node = found
            slots.append(node)
        return slots

    def split_waves(self, prompts: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
        """(leaders, others): indices of `prompts` to prefill first, one per prefix that
        several of them share (at least `MIN_SHARED_TOKENS` past what is cached), and the
        rest. No leaders when nothing is shared."""
        order = sorted(range(len(prompts)), key=lambda i: list(prompts[i]))
        leaders: list[int] = []
        followers: set[int] = set()
        for a, b in zip(order, order[1:], strict=False):
            pa, pb = prompts[a], prompts[b]
            shared = _common_prefix(pa, pb, min(len(pa), len(pb)) - 1)
            if shared - self.cached_length(pa) >= MIN_SHARED_TOKENS:
                if a not in followers:
                    leaders.append(a)
                followers.add(b)
        first = sorted(leaders)
        return first, [i for i in range(len(prompts)) if i not in set(first)]

    # -- moving KV between the store and the engine's cache rows ----------------------------
    def load(self, runner, targets: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Copy cached slots into the runner's cache: each (row, slots) fills positions
        [0, len(slots)) of cache row `row`."""
        places = [(row, pos, s) for row, slots in targets for pos, s in enumerate(slots)]
        self._copy(runner, places, into_store=False)

    def insert(
        self, runner, items: Sequence[tuple[Sequence[int], int, Anchor | None]]
    ) -> list[Anchor]:
        """Cache token sequences whose KV the runner's cache holds: each (tokens, row,
        anchor) has positions [0, len(tokens)) of cache row `row`. Tokens already cached
        are skipped; when the store is full, least-recently-used leaves make room.

        Returns each item's `Anchor`. Passed with a longer sequence that starts with the
        same tokens (a sample of the prompt inserted at prefill), it starts the walk where
        the earlier one ended instead of at the root."""
        self._clock += 1
        new: list[tuple[int, int, int]] = []  # (row, position, slot)
        ends: list[tuple[int, int]] = []
        child, used = self._child, self._used
        for tokens, row, anchor in items:
            node, depth = self._resume(anchor)
            for pos in range(depth, len(tokens)):
                t = tokens[pos]
                key = _key(node, t)
                slot = child.get(key)
                if slot is None:
                    slot = self._allocate()
                    if slot is None:
                        break
                    child[key] = slot
                    self._parent[slot], self._token[slot], self._children[slot] = node, t, 0
                    if node != _ROOT:
                        self._children[node] += 1
                    new.append((row, pos, slot))
                used[slot] = self._clock
                node, depth = slot, pos + 1
            ends.append((node, depth))
        self.stats["cached_tokens"] += len(new)
        self._copy(runner, new, into_store=True)
        # evictions by this insert spare its own nodes: the anchors hold at the new epoch
        return [Anchor(self._epoch, node, depth) for node, depth in ends]

    def insert_prompts(
        self, runner, prompts: Sequence[Sequence[int]], src: Sequence[int], first: int
    ) -> dict[int, Anchor]:
        """Cache a prefill wave's prompts longer than `MIN_SHARED_TOKENS` (a shorter one is
        not worth its copy: a hit would save at most that many prefill tokens), each from
        the cache row of its first sample (`src[j]`: the prompt of row `first + j`).
        Returns {prompt index: its anchor}, where its samples' inserts start."""
        long = [i for i, ids in enumerate(prompts) if len(ids) > MIN_SHARED_TOKENS]
        if not long:
            return {}
        rep = {i: first + j for j, i in reversed(list(enumerate(src)))}
        anchors = self.insert(runner, [(prompts[i], rep[i], None) for i in long])
        return dict(zip(long, anchors, strict=True))

    def insert_samples(
        self,
        runner,
        samples: Sequence[tuple[int, Sequence[int], Sequence[int], Sequence[int], Anchor | None]],
        version: int,
    ) -> None:
        """Cache finished samples, each (cache row, prompt ids, output ids, output versions,
        anchor): their KV (the prompt and all but the last sampled token) serves a next
        turn that quotes them. Samples with a token of older weights than `version` are
        left out (the cache holds the current weights' KV only)."""
        items = [
            ([*prompt, *out[:-1]], row, anchor)
            for row, prompt, out, versions, anchor in samples
            if versions and all(v == version for v in versions)
        ]
        if items:
            self.insert(runner, items)

    def _resume(self, anchor: Anchor | None) -> tuple[int, int]:
        """(node, tokens on its path) to start a walk at: the anchor's while nothing was
        evicted or cleared since it was made, else the root. The node is marked used, so
        that this insert's evictions keep it."""
        if anchor is None or anchor.epoch != self._epoch:
            return _ROOT, 0
        if anchor.slot != _ROOT:
            self._used[anchor.slot] = self._clock
        return anchor.slot, anchor.depth

    def _copy(self, runner, places: list[tuple[int, int, int]], into_store: bool) -> None:
        """Copy K and V of every layer between (cache row, position) and store slot, for
        each (row, position, slot) of `places`: into the store, or out of it."""
        if not places:
            return
        row, pos, slot = (torch.tensor(c) for c in zip(*places, strict=True))
        heads = torch.arange(self.n_kv)
        device = runner.k_cache[0].device
        # flat indices into the (slots*kv*max_len, D) cache view and (capacity*kv, D) store
        cache_idx = ((row[:, None] * self.n_kv + heads) * runner.max_len + pos[:, None]).flatten()
        store_idx = (slot[:, None] * self.n_kv + heads).flatten()
        cache_idx, store_idx = to_device(cache_idx, device), to_device(store_idx, device)
        d = runner.head_dim
        # fresh slots come in one ascending run: a gather straight into that span of the
        # store (on a CPU, index_copy_ costs several times a plain copy)
        first = places[0][2]
        run = into_store and torch.equal(slot, torch.arange(first, first + len(places)))
        span = slice(first * self.n_kv, (first + len(places)) * self.n_kv)
        for cache, store in zip(runner.k_cache + runner.v_cache, self.k + self.v, strict=True):
            cache, store = cache.view(-1, d), store.view(-1, d)
            if run:
                torch.index_select(cache, 0, cache_idx, out=store[span])
            elif into_store:
                store.index_copy_(0, store_idx, cache.index_select(0, cache_idx))
            else:
                cache.index_copy_(0, cache_idx, store.index_select(0, store_idx))

    # -- eviction ---------------------------------------------------------------------------
    def _allocate(self) -> int | None:
        """A free slot, evicting old leaves when none is left; None when every cached
        token was used by the current insert (the rest of the prompt is not cached)."""
        if self._fresh < self.capacity:
            self._fresh += 1
            return self._fresh - 1
        if not self._free:
            self._evict(max(1, self.capacity // 8))
        return self._free.pop() if self._free else None

    def _evict(self, count: int) -> None:
        """Free up to `count` slots, least recently used leaves first (a parent whose
        last child goes becomes a leaf); never a node used by the running insert."""
        used, children = self._used, self._children
        heap = [(used[s], s) for s in self._child.values() if not children[s]]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < count:
            last, slot = heapq.heappop(heap)
            if last >= self._clock:
                break
            parent = self._parent[slot]
            del self._child[_key(parent, self._token[slot])]
            self._free.append(slot)
            freed += 1
            if parent != _ROOT:
                children[parent] -= 1
                if not children[parent]:
                    heapq.heappush(heap, (used[parent], parent))
        self.stats["evicted_tokens"] += freed
        self.stats["cached_tokens"] -= freed
        self._epoch += 1


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n
