from __future__ import annotations

import pytest

from nexrl.inference.hf_engine import HFEngine
from nexrl.inference.protocol import GenerationRequest, InferenceEngine, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_path):
    return HFEngine(tiny_path)


def _req(engine, text="hello ", **kw):
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    return GenerationRequest(ids, SamplingParams(**kw))


def test_is_inference_engine(engine):
    assert isinstance(engine, InferenceEngine)


def test_logprobs_match_trainer(engine, hf_model, trainer_logprobs):
    req = _req(engine, max_new_tokens=12, temperature=1.0, seed=3, n=2)
    resp = engine.generate(req)
    assert len(resp.outputs) == 2
    for out in resp.outputs:
        full = req.input_ids + out.output_ids
        ref = trainer_logprobs(hf_model, full)[len(req.input_ids) - 1 :]
        assert out.output_logprobs == pytest.approx(ref, abs=1e-4)
        assert out.output_versions == [0] * len(out.output_ids)


def test_seed_reproducible_and_greedy(engine):
    a = engine.generate(_req(engine, max_new_tokens=10, seed=7))
    b = engine.generate(_req(engine, max_new_tokens=10, seed=7))
    assert a.outputs[0].output_ids == b.outputs[0].output_ids
    g = engine.generate(_req(engine, max_new_tokens=10, temperature=0.0, n=2))
    assert g.outputs[0].output_ids == g.outputs[1].output_ids


def test_stop_token_ends_sample(engine):
    greedy = engine.generate(_req(engine, max_new_tokens=10, temperature=0.0)).outputs[0]
    assert greedy.finish_reason in ("length", "stop")
    stop_at = greedy.output_ids[3]
    out = engine.generate(
        _req(engine, max_new_tokens=10, temperature=0.0, stop_token_ids=[stop_at])
    ).outputs[0]
    first = greedy.output_ids.index(stop_at)
    assert out.output_ids == greedy.output_ids[: first + 1]
    assert out.finish_reason == "stop"
