"""The two-level inverse-CDF sampler: exact frequencies, exclusions, seeds."""

from __future__ import annotations

import math

import torch

from nexrl.inference.sampler import CDF_BLOCK, SampleKinds, _inverse_cdf, sample_next


def test_inverse_cdf_matches_the_distribution_across_blocks() -> None:
    torch.manual_seed(0)
    vocab = 2 * CDF_BLOCK + 37  # a ragged last block
    logits = torch.randn(vocab) * 2
    logits[3] = logits[vocab - 1] = float("-inf")  # excluded tokens, first and last block
    logits[CDF_BLOCK + 5] = logits.max() + 4  # one heavy token next to many rare ones
    logp = torch.log_softmax(logits, -1)
    n = 400_000
    u = 1.0 - torch.rand(n, 2, dtype=torch.float64)
    tokens, mass = _inverse_cdf(logp.exp().expand(n, vocab), u)
    assert torch.allclose(mass, torch.ones(n, dtype=torch.float64))
    freq = torch.bincount(tokens, minlength=vocab).double() / n
    p = logp.exp().double()
    assert freq[3] == 0 and freq[vocab - 1] == 0 and tokens.max() < vocab
    sigma = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 5 * sigma + 1e-6).all()


def test_unnormalised_truncated_rows_sample_their_kept_tokens_only() -> None:
    logp = torch.full((4, 300), float("-inf"))
    logp[0, 299] = -5.0  # a single kept token, far below probability 1
    logp[1, [0, 1]] = -9.0
    logp[2, 256] = 0.0  # first token of the last, ragged block
    logp[3, :] = 0.0
    u = torch.tensor([[1.0, 1.0], [1e-12, 1e-12], [0.5, 0.5], [1.0, 1.0]], dtype=torch.float64)
    tokens, mass = _inverse_cdf(logp.exp(), u)
    kept = torch.tensor([math.exp(-5.0), 2 * math.exp(-9.0), 1.0, 300.0], dtype=torch.float64)
    assert torch.allclose(mass, kept)  # each row's total weight, unnormalised
    assert tokens[:3].tolist() == [299, 0, 256] and tokens[3] == 299


def test_seeded_rows_repeat_whatever_shares_the_batch() -> None:
    logits = torch.randn(3, 1000)
    ones, k = torch.ones(3), torch.zeros(3, dtype=torch.long)
    kinds = SampleKinds(greedy=False, tempered=False, truncated=False)

    def draw(other_seed: int) -> torch.Tensor:
        gens = {1: torch.Generator().manual_seed(7)}
        default = torch.Generator().manual_seed(other_seed)
        tokens, logprobs = sample_next(logits, ones, ones, k, gens, default, kinds)
        expected = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
        assert torch.allclose(logprobs, expected)
        return tokens

    draws = [draw(seed) for seed in range(20)]
    assert len({int(t[1]) for t in draws}) == 1  # the seeded row
    assert len({int(t[0]) for t in draws}) > 1  # the others vary with the default generator


def test_untruncated_logprobs_equal_log_softmax_at_every_temperature() -> None:
    """The untruncated path reports log_softmax(logits / T)[token] from its own block sums
    (greedy rows: log_softmax(logits)[argmax]), over a vocabulary of ragged blocks."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 3 * CDF_BLOCK + 11, generator=gen) * 4
    temperature = torch.tensor([1.0, 0.5, 2.0, 0.0, 1.0, 0.7])
    ones, k = torch.ones(6), torch.zeros(6, dtype=torch.long)
    kinds = SampleKinds(greedy=True, tempered=True, truncated=False)
    tokens, logprobs = sample_next(logits, temperature, ones, k, None, gen, kinds)
    scale = torch.where(temperature > 0, temperature, torch.ones(6))[:, None]
    want = torch.log_softmax(logits / scale, -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs, want, atol=1e-5, rtol=0)
    assert tokens[3] == logits[3].argmax()


def test_a_one_block_vocabulary_draws_as_the_two_level_sampler() -> None:
    # vocabularies up to CDF_BLOCK skip the block level; zero-padding the same weights
    # past one block takes the two-level path, which must pick the same tokens
    gen = torch.Generator().manual_seed(1)
    for vocab in (1, 58, CDF_BLOCK):
        weights = (torch.randn(512, vocab, generator=gen) * 3).exp()
        if vocab > 2:
            weights[:, 0] = 0.0  # an excluded first token
            weights[::2, -1] = 0.0  # and an excluded last one
        weights[0] = 0.0
        weights[0, vocab - 1] = 1.0  # a row whose only token is the last
        u = 1.0 - torch.rand(512, 2, dtype=torch.float64, generator=gen)
        u[:2] = torch.tensor([[1.0, 1.0], [1e-12, 1e-12]], dtype=torch.float64)  # the ends
        padded = torch.nn.functional.pad(weights, (0, CDF_BLOCK + 1 - vocab))
        tokens, mass = _inverse_cdf(weights, u)
        want_tokens, want_mass = _inverse_cdf(padded, u)
        assert torch.equal(tokens, want_tokens)
        torch.testing.assert_close(mass, want_mass, rtol=1e-6, atol=0)
        assert tokens.max() < vocab and (weights.gather(1, tokens[:, None]) > 0).all()


def test_a_small_vocabulary_matches_its_distribution_and_logprobs() -> None:
    torch.manual_seed(2)
    vocab, n = 58, 200_000
    logits = torch.randn(vocab) * 2
    logits[7] = float("-inf")
    ones, k = torch.ones(n), torch.zeros(n, dtype=torch.long)
    kinds = SampleKinds(greedy=False, tempered=False, truncated=False)
    tokens, logprobs = sample_next(logits.expand(n, vocab), ones, ones, k, None, None, kinds)
    logp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(logprobs, logp[tokens], atol=1e-5, rtol=0)
    freq = torch.bincount(tokens, minlength=vocab).double() / n
    p = logp.exp().double()
    assert freq[7] == 0
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-6).all()
