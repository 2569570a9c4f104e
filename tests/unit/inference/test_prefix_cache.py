"""The engine's prefix cache: cached prompt KV gives the same tokens and logprobs as a
full prefill, prompts admitted together share their common prefix through two waves,
old entries make room for new ones without breaking the trie, and a weight update
forgets everything."""

from __future__ import annotations

import random
import time

import pytest
import torch

from nexrl.inference.engine import Engine
from nexrl.inference.factory import build_local_engine
from nexrl.inference.prefix_cache import MIN_SHARED_TOKENS, PrefixCache
from nexrl.inference.protocol import GenerationRequest, SamplingParams, WeightUpdateMeta

SYSTEM = list(range(3, 3 + 24))  # a shared "system prompt" of 24 tokens


def _chats(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [SYSTEM + [rng.randint(3, 50) for _ in range(rng.randint(1, 9))] for _ in range(count)]


def _run(engine: Engine, prompts, n: int = 1, temperature: float = 0.0):
    """Outputs of `prompts` submitted together (seeded: the same draws in any engine)."""
    futures = [
        engine.submit(GenerationRequest(list(p), _params(n, temperature, seed=i)))
        for i, p in enumerate(prompts)
    ]
    return [f.result().outputs for f in futures]


def _params(n: int, temperature: float, seed: int) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=6, n=n, temperature=temperature, seed=seed, ignore_eos=True
    )


@pytest.fixture(scope="module")
def plain(tiny_path):
    engine = Engine(tiny_path, max_batch_size=32, prefix_cache_gib=0)
    yield engine
    engine.shutdown()


def _same(a, b, tol: float = 1e-5) -> None:
    for outs_a, outs_b in zip(a, b, strict=True):
        for x, y in zip(outs_a, outs_b, strict=True):
            assert x.output_ids == y.output_ids
            gaps = zip(x.output_logprobs, y.output_logprobs, strict=True)
            assert max(abs(u - v) for u, v in gaps) < tol


@pytest.mark.parametrize("n", [1, 3])
def test_cached_prefix_matches_full_prefill(tiny_path, plain, n):
    prompts = _chats(8)
    want = _run(plain, prompts, n, temperature=1.0)
    assert plain.stats["prefix_hit_tokens"] == 0
    engine = Engine(tiny_path, max_batch_size=32, prefix_cache_gib=0.01)
    try:
        first = _run(engine, prompts, n, temperature=1.0)  # one burst: split in two waves
        hits_first = engine.stats["prefix_hit_tokens"]
        again = _run(engine, prompts, n, temperature=1.0)  # all but each last token cached
        _same(want, first)
        _same(want, again)
        assert hits_first >= 7 * len(SYSTEM)  # the 7 followers read the system prompt
        assert engine.stats["prefix_hit_tokens"] - hits_first == sum(len(p) - 1 for p in prompts)
    finally:
        engine.shutdown()


def test_burst_with_a_shared_prefix_prefills_one_prompt_first(tiny_path):
    engine = Engine(tiny_path, max_batch_size=32, prefix_cache_gib=0.01, gather_max_s=1.0)
    calls: list[int] = []
    prefill = engine.runner.prefill

    def counted(tokens, *args):
        calls.append(int(tokens.shape[0]))
        return prefill(tokens, *args)

    engine.runner.prefill = counted
    try:
        _run(engine, _chats(6))
        assert calls == [1, 5]
        calls.clear()
        _run(engine, [[7, 8, 9, 10], [11, 12, 13]])  # nothing shared: one wave
        assert calls == [2]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("cache_output", [True, False])
def test_multi_turn_prompt_reads_the_earlier_turn_and_its_reply(tiny_path, plain, cache_output):
    turn1 = _chats(1, seed=3)[0]
    engine = Engine(tiny_path, max_batch_size=8, prefix_cache_gib=0.01)
    try:
        request = GenerationRequest(list(turn1), _params(1, 0.0, 0), cache_output=cache_output)
        reply = engine.generate(request).outputs[0].output_ids
        turn2 = turn1 + reply + [40, 41, 42]
        before = engine.stats["prefix_hit_tokens"]
        _same(_run(plain, [turn2]), _run(engine, [turn2]))
        # the reply's last token was sampled, never fed back: it has no KV; without
        # `cache_output` only the first turn's prompt was kept
        hits = len(turn1) + len(reply) - 1 if cache_output else len(turn1)
        assert engine.stats["prefix_hit_tokens"] - before == hits
    finally:
        engine.shutdown()


@pytest.mark.parametrize("length", [MIN_SHARED_TOKENS, MIN_SHARED_TOKENS + 1])
def test_a_prompt_is_cached_only_past_min_shared_tokens(tiny_path, length):
    """A hit on a prompt of at most MIN_SHARED_TOKENS tokens would save no more prefill
    than that: it is not copied into the cache, and a later request quoting it reads
    nothing; one token longer, it is cached and read back."""
    prompt = list(range(3, 3 + length))
    engine = Engine(tiny_path, max_batch_size=8, prefix_cache_gib=0.01)
    try:
        engine.generate(GenerationRequest(prompt, _params(1, 0.0, 0), cache_output=False))
        cached = engine.prefix.stats["cached_tokens"]
        assert cached == (0 if length <= MIN_SHARED_TOKENS else length)
        _run(engine, [prompt + [40]])
        assert engine.stats["prefix_hit_tokens"] == cached
    finally:
        engine.shutdown()


def test_sample_spanning_a_weight_update_is_not_cached(tiny_path, other_weights_path):
    prompt = _chats(1, seed=4)[0]
    engine = Engine(
        tiny_path, max_batch_size=8, prefix_cache_gib=0.01, emulated_step_latency_s=0.01
    )
    try:
        params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
        future = engine.submit(GenerationRequest(list(prompt), params))
        while engine.stats["generated_tokens"] < 5:
            time.sleep(0.005)
        engine.update_weights(WeightUpdateMeta(version=1, path=str(other_weights_path)))
        out = future.result().outputs[0]
        assert set(out.output_versions) == {0, 1}  # continued on the new weights
        assert engine.prefix.stats["cached_tokens"] == 0  # old KV: neither kept nor added
    finally:
        engine.shutdown()


def test_weight_update_clears_the_cache(tiny_path, other_weights_path):
    prompts = _chats(2, seed=5)
    engine = Engine(tiny_path, max_batch_size=8, prefix_cache_gib=0.01)
    fresh = Engine(other_weights_path, max_batch_size=8, prefix_cache_gib=0)
    try:
        _run(engine, prompts)
        assert engine.prefix.stats["cached_tokens"] > 0
        engine.update_weights(WeightUpdateMeta(version=1, path=str(other_weights_path)))
        assert engine.prefix.stats["cached_tokens"] == 0
        before = engine.stats["prefix_hit_tokens"]
        _same(_run(fresh, prompts), _run(engine, prompts))  # new weights, no stale KV
        assert engine.stats["prefix_hit_tokens"] - before >= len(SYSTEM)  # the new wave's
        engine.reset_prefix_cache()
        assert engine.prefix.stats["cached_tokens"] == 0
    finally:
        engine.shutdown()
        fresh.shutdown()


def test_bf16_cache_matches_bf16_prefill(tiny_path):
    prompts = _chats(4, seed=7)
    engines = [
        Engine(tiny_path, max_batch_size=8, dtype="bfloat16", prefix_cache_gib=g) for g in (0, 0.01)
    ]
    try:
        want = _run(engines[0], prompts)
        _run(engines[1], prompts)
        _same(want, _run(engines[1], prompts), tol=1e-2)
        assert engines[1].stats["prefix_hit_tokens"] > 0
    finally:
        for e in engines:
            e.shutdown()


class _Runner:
    """The part of `ModelRunner` the cache reads: one layer, 2 kv heads of 4 dims."""

    def __init__(self, rows: int = 4, max_len: int = 32) -> None:
        self.n_kv, self.head_dim, self.max_len = 2, 4, max_len
        self.k_cache = [torch.randn(rows, 2, max_len, 4)]
        self.v_cache = [torch.randn(rows, 2, max_len, 4)]


def test_eviction_keeps_recent_prefixes_and_whole_paths():
    runner = _Runner()
    cache = PrefixCache(1, 2, 4, capacity=16, dtype=torch.float32, device=torch.device("cpu"))
    old, recent = list(range(100, 110)), list(range(200, 206))
    cache.insert(runner, [(old, 0, None)])
    cache.insert(runner, [(recent, 1, None)])
    assert cache.match(recent + [1]) and len(cache.match(old + [1])) == 10
    cache.match(recent + [1])  # recent is now the most recently used
    cache.insert(runner, [(list(range(300, 306)), 2, None)])  # 6 more: the oldest leaves go
    assert len(cache.match(recent + [1])) == 6
    kept = cache.cached_length(old + [1])
    assert kept < 10 and cache.stats["evicted_tokens"] >= 6
    assert cache.stats["cached_tokens"] == 16 - len(cache._free)
    # what is cached of `old` is a prefix, and its KV is the row's
    row = torch.zeros(1, dtype=torch.long)
    target = _Runner(rows=1)
    cache.load(target, [(0, cache.match(old + [1]))])
    assert torch.equal(target.k_cache[0][row, :, :kept], runner.k_cache[0][row, :, :kept])
    assert torch.equal(target.v_cache[0][row, :, :kept], runner.v_cache[0][row, :, :kept])


def _kv_matches(cache: PrefixCache, runner: _Runner, row: int, tokens: list[int]) -> bool:
    """The cached KV of `tokens` is what row `row` of `runner` holds at their positions."""
    target = _Runner(rows=1)
    slots = cache.match(tokens + [1])
    cache.load(target, [(0, slots)])
    n = len(slots)
    return all(
        torch.equal(t[0][0, :, :n], r[0][row, :, :n])
        for t, r in ((target.k_cache, runner.k_cache), (target.v_cache, runner.v_cache))
    )


def test_an_anchor_starts_a_longer_insert_where_its_prefix_ended():
    runner = _Runner()
    cache = PrefixCache(1, 2, 4, capacity=64, dtype=torch.float32, device=torch.device("cpu"))
    prompt = list(range(100, 110))
    (anchor,) = cache.insert(runner, [(prompt, 0, None)])
    assert (anchor.depth, cache.stats["cached_tokens"]) == (10, 10)
    sample = prompt + [7, 8, 9]  # row 1 holds the sample: its prompt KV was copied there
    runner.k_cache[0][1, :, :10] = runner.k_cache[0][0, :, :10]
    runner.v_cache[0][1, :, :10] = runner.v_cache[0][0, :, :10]
    (end,) = cache.insert(runner, [(sample, 1, anchor)])
    assert end.depth == 13 and cache.stats["cached_tokens"] == 13
    assert cache.cached_length(sample + [1]) == 13 and _kv_matches(cache, runner, 1, sample)


def test_a_stale_anchor_walks_from_the_root():
    """An eviction may give the anchor's slot to another token: the walk must not start
    there (the sample would hang under that token and never be found)."""
    runner = _Runner()
    cache = PrefixCache(1, 2, 4, capacity=16, dtype=torch.float32, device=torch.device("cpu"))
    old = list(range(100, 110))
    (anchor,) = cache.insert(runner, [(old, 0, None)])
    cache.insert(runner, [(list(range(200, 206)), 1, None)])
    cache.insert(runner, [(list(range(300, 306)), 2, None)])  # evicts the end of `old`
    assert cache.cached_length(old + [1]) < 10
    (end,) = cache.insert(runner, [(old + [7, 8], 0, anchor)])
    assert end.depth == cache.cached_length(old + [7, 8, 1]) > 0
    assert _kv_matches(cache, runner, 0, old + [7, 8])
    cache.clear()  # a weight update: every anchor is void
    (end,) = cache.insert(runner, [(old + [7, 8], 0, end)])
    assert cache.cached_length(old + [7, 8, 1]) == end.depth == 12


def test_split_waves_needs_a_shared_uncached_prefix():
    runner = _Runner(max_len=64)
    cache = PrefixCache(1, 2, 4, capacity=256, dtype=torch.float32, device=torch.device("cpu"))
    shared = list(range(1, 1 + MIN_SHARED_TOKENS))
    prompts = [shared + [50], [9, 9], shared + [51, 52], shared[:-1] + [60]]
    assert cache.split_waves(prompts) == ([0], [1, 2, 3])
    cache.insert(runner, [(shared, 0, None)])  # cached now: nothing left to share
    assert cache.split_waves(prompts) == ([], [0, 1, 2, 3])


def test_option_is_checked_and_reaches_the_engine(tiny_path):
    with pytest.raises(ValueError, match="prefix_cache_gib"):
        Engine(tiny_path, max_batch_size=4, prefix_cache_gib=-1)
    engine = build_local_engine(
        {"model": str(tiny_path), "max_batch_size": 4, "prefix_cache_gib": 0}
    )
    try:
        assert engine.prefix is None
        _run(engine, _chats(3))
        assert engine.stats["prefix_hit_tokens"] == 0
    finally:
        engine.shutdown()
