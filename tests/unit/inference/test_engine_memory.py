"""KV-cache sizing of the built-in engine: by max_model_len and a memory budget."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from nexrl.inference.engine import Engine, check_fits
from nexrl.inference.model_runner import kv_bytes_per_token, plan_kv_cache
from nexrl.inference.protocol import GenerationRequest, SamplingParams

# SmolLM2-135M's shape: 30 layers, 3 KV heads of 64, 8192 positions
SMOL = LlamaConfig(
    hidden_size=576,
    num_attention_heads=9,
    num_key_value_heads=3,
    num_hidden_layers=30,
    max_position_embeddings=8192,
)


def test_bytes_per_token_of_smollm2_shape():
    assert kv_bytes_per_token(SMOL, torch.float32) == 2 * 30 * 3 * 64 * 4  # 46 080
    assert kv_bytes_per_token(SMOL, torch.bfloat16) == 2 * 30 * 3 * 64 * 2


def test_default_length_comes_from_the_budget_not_the_context():
    length = plan_kv_cache(SMOL, torch.float32, 128, None, kv_cache_gib=2.0)
    assert length == (2 * 2**30 // (46080 * 128)) // 16 * 16 == 352
    assert 128 * length * 46080 <= 2 * 2**30
    # a small model's whole context fits: capped by max_position_embeddings
    small = LlamaConfig(num_hidden_layers=2, max_position_embeddings=256, hidden_size=64)
    assert plan_kv_cache(small, torch.float32, 128, None) == 256


def test_a_length_that_does_not_fit_the_budget_is_an_error_not_an_allocation():
    with pytest.raises(ValueError, match="kv_cache_gib.*max_model_len.*max_batch_size"):
        plan_kv_cache(SMOL, torch.float32, 128, 8192, kv_cache_gib=2.0)
    assert plan_kv_cache(SMOL, torch.float32, 64, 512, kv_cache_gib=2.0) == 512
    with pytest.raises(ValueError, match="max_position_embeddings"):
        plan_kv_cache(SMOL, torch.float32, 1, 9000, kv_cache_gib=100)
    with pytest.raises(ValueError, match="raise kv_cache_gib"):
        plan_kv_cache(SMOL, torch.float32, 4096, None, kv_cache_gib=0.1)


def test_request_that_cannot_fit_names_its_lengths():
    check_fits(10, 22, 32)
    with pytest.raises(ValueError, match=r"prompt has 10 tokens \+ max_new_tokens 23 = 33 > "):
        check_fits(10, 23, 32)
    with pytest.raises(ValueError, match="max_model_len 32"):
        check_fits(32, 0, 32)


def test_engine_sizes_its_cache_by_max_model_len(tiny_path):
    engine = Engine(tiny_path, max_batch_size=4, max_model_len=40)
    try:
        assert engine.runner.k_cache[0].shape[2] == 40
        assert engine.batch.out_tok.shape == (4, 40)
        ok = engine.generate(GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=37)))
        assert len(ok.outputs[0].output_ids) <= 37
        with pytest.raises(ValueError, match="max_model_len 40"):
            engine.generate(GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=38)))
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="kv_cache_gib"):
        Engine(tiny_path, max_batch_size=4, max_model_len=200, kv_cache_gib=1e-6)
