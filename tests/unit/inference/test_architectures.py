"""The lean forward on each supported family matches the HF forward; others fall back."""

from __future__ import annotations

import pytest
import torch

from nexrl.inference.engine import Engine, build_engine
from nexrl.inference.hf_engine import HFEngine
from nexrl.inference.protocol import GenerationRequest, SamplingParams
from nexrl.models.tiny import build_char_tokenizer


def _save(config_cls, model_cls, path, **extra):
    tok = build_char_tokenizer(path)
    cfg = config_cls(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **extra,
    )
    torch.manual_seed(0)
    model_cls(cfg).save_pretrained(str(path))
    return path


def _families():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    return {
        "llama": (LlamaConfig, LlamaForCausalLM, {"head_dim": 16}),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 24}),  # head_dim != hidden/heads
        "llama3-rope": (
            LlamaConfig,
            LlamaForCausalLM,
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                }
            },
        ),
    }


@pytest.mark.parametrize("family", ["llama", "qwen3", "llama3-rope"])
def test_lean_forward_parity(tmp_path, family, trainer_logprobs):
    from transformers import AutoModelForCausalLM

    cfg_cls, model_cls, extra = _families()[family]
    path = _save(cfg_cls, model_cls, tmp_path / family, **extra)
    engine = build_engine(path, max_batch_size=4)
    try:
        assert isinstance(engine, Engine)
        prompt = list(range(10, 40))
        req = GenerationRequest(prompt, SamplingParams(max_new_tokens=40, n=2, seed=0))
        ref_model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
        for out in engine.generate(req).outputs:
            ref = trainer_logprobs(ref_model, prompt + out.output_ids)[len(prompt) - 1 :]
            assert out.output_logprobs == pytest.approx(ref, abs=1e-4)
    finally:
        engine.shutdown()


def test_unsupported_architecture_falls_back_to_hf(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = build_char_tokenizer(tmp_path / "gpt2")
    cfg = GPT2Config(
        vocab_size=len(tok),
        n_embd=32,
        n_layer=1,
        n_head=2,
        n_positions=64,
        eos_token_id=tok.eos_token_id,
    )
    GPT2LMHeadModel(cfg).save_pretrained(str(tmp_path / "gpt2"))
    engine = build_engine(tmp_path / "gpt2")
    assert isinstance(engine, HFEngine)
    out = engine.generate(GenerationRequest([5, 6], SamplingParams(max_new_tokens=3))).outputs[0]
    assert len(out.output_ids) <= 3
