"""The built-in engine: parity with the trainer, sampling, batching, control."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from nexrl.inference.engine import Engine, build_engine
from nexrl.inference.hf_engine import HFEngine
from nexrl.inference.protocol import (
    GenerationRequest,
    InferenceEngine,
    SamplingParams,
    WeightUpdateMeta,
)

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def engine(tiny_path):
    eng = Engine(tiny_path, max_batch_size=32)
    yield eng
    eng.shutdown()


def _gen(engine, ids=PROMPT, rid=None, **kw):
    return engine.generate(GenerationRequest(list(ids), SamplingParams(**kw), rid=rid))


def test_protocol_and_factory(engine, tiny_path):
    assert isinstance(engine, InferenceEngine)
    assert engine.health()


def test_logprob_parity_with_trainer(engine, hf_model, trainer_logprobs):
    """Engine logprobs == log_softmax(full forward) of the trainer, within 1e-4 (fp32)."""
    resp = _gen(engine, max_new_tokens=30, n=4, seed=11, ignore_eos=True)
    for out in resp.outputs:
        ref = trainer_logprobs(hf_model, PROMPT + out.output_ids)[len(PROMPT) - 1 :]
        assert len(out.output_logprobs) == len(out.output_ids) > 0
        assert max(abs(a - b) for a, b in zip(out.output_logprobs, ref, strict=True)) < 1e-4


def test_rows_moved_when_others_finish_keep_their_cache(engine, hf_model, trainer_logprobs):
    """Short requests ahead of a long one finish first; the long one's row is moved into
    a freed slot (only its filled positions are copied) and its logprobs stay exact."""
    with ThreadPoolExecutor(4) as pool:
        short = [
            pool.submit(_gen, engine, [9, 8, 7], max_new_tokens=n, ignore_eos=True)
            for n in (1, 2, 3)
        ]
        long = pool.submit(_gen, engine, max_new_tokens=30, seed=3, ignore_eos=True)
        [f.result() for f in short]
        out = long.result().outputs[0]
    ref = trainer_logprobs(hf_model, PROMPT + out.output_ids)[len(PROMPT) - 1 :]
    assert len(out.output_ids) == 30
    assert max(abs(a - b) for a, b in zip(out.output_logprobs, ref, strict=True)) < 1e-4


def test_greedy_matches_hf_generate(engine, tiny_path):
    hf = HFEngine(tiny_path)
    ids = list(range(10, 30))
    ours = _gen(engine, ids, max_new_tokens=20, temperature=0.0).outputs[0]
    ref = hf.generate(GenerationRequest(ids, SamplingParams(max_new_tokens=20, temperature=0.0)))
    assert ours.output_ids == ref.outputs[0].output_ids
    assert ours.finish_reason == ref.outputs[0].finish_reason


def test_seed_gives_same_output_whatever_the_batch(engine):
    alone = _gen(engine, max_new_tokens=25, seed=5, n=2)
    with ThreadPoolExecutor(8) as pool:
        others = [pool.submit(_gen, engine, [7, 8], max_new_tokens=40) for _ in range(6)]
        again = pool.submit(_gen, engine, max_new_tokens=25, seed=5, n=2).result()
        [f.result() for f in others]
    assert [o.output_ids for o in alone.outputs] == [o.output_ids for o in again.outputs]
    assert alone.outputs[0].output_ids != alone.outputs[1].output_ids  # samples differ


def test_temperature_sharpens_and_topk_restricts(engine, hf_model):
    out = _gen(engine, max_new_tokens=40, top_k=1, ignore_eos=True).outputs[0]
    greedy = _gen(engine, max_new_tokens=40, temperature=0.0).outputs[0]
    n = min(len(out.output_ids), len(greedy.output_ids))
    assert out.output_ids[:n] == greedy.output_ids[:n]
    # top_p tiny keeps only the argmax token too
    nucleus = _gen(engine, max_new_tokens=40, top_p=1e-6).outputs[0]
    assert nucleus.output_ids[:n] == greedy.output_ids[:n]


def test_stop_tokens_strings_and_length(engine):
    greedy = _gen(engine, max_new_tokens=12, temperature=0.0, ignore_eos=True).outputs[0]
    tok = greedy.output_ids[4]
    first = greedy.output_ids.index(tok)
    stopped = _gen(engine, max_new_tokens=12, temperature=0.0, stop_token_ids=[tok]).outputs[0]
    assert stopped.output_ids == greedy.output_ids[: first + 1]
    assert stopped.finish_reason == "stop"
    text = engine.tokenizer.decode(greedy.output_ids)
    stop_str = text[5:7]
    by_str = _gen(engine, max_new_tokens=12, temperature=0.0, stop=[stop_str]).outputs[0]
    assert by_str.finish_reason == "stop"
    assert by_str.text == text[: text.find(stop_str)]
    assert _gen(engine, max_new_tokens=3, ignore_eos=True).outputs[0].finish_reason == "length"
    empty = _gen(engine, max_new_tokens=0).outputs[0]
    assert empty.output_ids == [] and empty.finish_reason == "length"


def test_concurrent_requests_share_the_batch(engine):
    steps_before = engine.stats["steps"]
    with ThreadPoolExecutor(16) as pool:
        futs = [
            pool.submit(_gen, engine, [5 + i % 7, 6], max_new_tokens=20, ignore_eos=True)
            for i in range(16)
        ]
        outs = [f.result() for f in futs]
    total = sum(len(o.outputs[0].output_ids) for o in outs)
    assert total > 16
    # continuous batching: far fewer steps than tokens generated one by one
    assert engine.stats["steps"] - steps_before < total


def test_bad_requests_raise_clear_errors(engine):
    with pytest.raises(ValueError, match="max_new_tokens"):
        _gen(engine, max_new_tokens=-1)
    with pytest.raises(ValueError, match="max_model_len"):
        _gen(engine, list(range(3, 90)) * 3)
    with pytest.raises(ValueError, match="top_p"):
        _gen(engine, top_p=0.0)


def test_abort_returns_partial_output(tiny_path):
    eng = Engine(tiny_path, max_batch_size=8)
    try:
        eng.pause()
        fut = eng.submit(
            GenerationRequest(PROMPT, SamplingParams(max_new_tokens=100, ignore_eos=True), "r1")
        )
        other = eng.submit(GenerationRequest(PROMPT, SamplingParams(max_new_tokens=5), "r2"))
        eng.resume()
        while eng.stats["generated_tokens"] < 10:
            threading.Event().wait(0.001)
        eng.abort("r1")
        out = fut.result(timeout=30).outputs[0]
        assert out.finish_reason == "abort"
        assert 0 < len(out.output_ids) < 100
        assert len(out.output_logprobs) == len(out.output_ids)
        assert other.result(timeout=30).outputs[0].finish_reason != "abort"
    finally:
        eng.shutdown()


def test_request_ids_are_unique_across_submitting_threads(engine):
    """Requests without a `rid` get one from the engine (abort finds them by it): distinct
    however many threads submit at once; a caller's own `rid` is kept."""

    def submit(_: int) -> str:
        request = GenerationRequest(PROMPT, SamplingParams(max_new_tokens=0))
        engine.submit(request).result(timeout=30)
        return request.rid

    with ThreadPoolExecutor(8) as pool:
        rids = list(pool.map(submit, range(400)))
    assert len(set(rids)) == 400 and all(rids)
    mine = GenerationRequest(PROMPT, SamplingParams(max_new_tokens=0), rid="mine")
    assert engine.submit(mine).result(timeout=30).rid == "mine"


def test_pause_holds_and_weight_update_bumps_version(tiny_path, other_weights_path):
    eng = build_engine(tiny_path, max_batch_size=8)
    assert isinstance(eng, Engine)
    try:
        before = _gen(eng, max_new_tokens=20, temperature=0.0, ignore_eos=True).outputs[0]
        eng.pause()
        fut = eng.submit(
            GenerationRequest(PROMPT, SamplingParams(max_new_tokens=20, temperature=0.0))
        )
        threading.Event().wait(0.2)
        assert not fut.done()  # paused: nothing runs
        eng.update_weights(WeightUpdateMeta(version=1, path=str(other_weights_path)))
        assert eng.version == 1
        eng.resume()
        after = fut.result(timeout=30).outputs[0]
        assert after.output_versions == [1] * len(after.output_ids)
        assert after.output_logprobs != pytest.approx(before.output_logprobs, abs=1e-3)
        # in-memory state dict: back to the original weights, version 2
        from transformers import AutoModelForCausalLM

        orig = AutoModelForCausalLM.from_pretrained(str(tiny_path)).state_dict()
        eng.update_weights(WeightUpdateMeta(version=2, state_dict=orig))
        again = _gen(eng, max_new_tokens=20, temperature=0.0, ignore_eos=True).outputs[0]
        assert again.output_ids == before.output_ids and eng.version == 2
        assert again.output_logprobs == pytest.approx(before.output_logprobs, abs=1e-5)
    finally:
        eng.shutdown()


def test_partial_rollout_spans_versions(tiny_path, other_weights_path):
    eng = Engine(tiny_path, max_batch_size=4)
    try:
        fut = eng.submit(
            GenerationRequest(PROMPT, SamplingParams(max_new_tokens=200, ignore_eos=True))
        )
        while eng.stats["generated_tokens"] < 5:
            threading.Event().wait(0.001)
        eng.pause()
        eng.update_weights(WeightUpdateMeta(version=3, path=str(other_weights_path)))
        eng.resume()
        out = fut.result(timeout=60).outputs[0]
        assert out.output_versions[0] == 0 and out.output_versions[-1] == 3
        assert out.output_versions == sorted(out.output_versions)
    finally:
        eng.shutdown()


def test_agenerate(engine):
    import asyncio

    async def main():
        reqs = [GenerationRequest(PROMPT, SamplingParams(max_new_tokens=5)) for _ in range(4)]
        return await asyncio.gather(*(engine.agenerate(r) for r in reqs))

    outs = asyncio.run(main())
    assert len(outs) == 4 and all(len(o.outputs) == 1 for o in outs)


def test_sampler_follows_the_distribution():
    """Sampling frequencies match softmax(logits / T); top-k zeroes the rest."""
    from nexrl.inference.sampler import sample_next

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    ones = torch.ones(20000)
    gen = torch.Generator().manual_seed(0)
    for temp in (1.0, 0.5):
        tok, lp = sample_next(
            logits, ones * temp, ones, torch.zeros(20000, dtype=torch.long), None, gen
        )
        freq = torch.bincount(tok, minlength=4).float() / 20000
        expect = torch.softmax(logits[0] / temp, -1)
        assert torch.allclose(freq, expect, atol=0.015)
        assert torch.allclose(lp, torch.log_softmax(logits[0] / temp, -1)[tok])
    tok, _ = sample_next(logits, ones, ones, torch.full((20000,), 2), None, gen)
    assert set(tok.tolist()) == {0, 1}


def test_a_ready_made_model_keeps_its_device(hf_model):
    """An engine given a model runs on that model's device, whatever `device` says: the
    running batch's tensors are where the model is (a GPU model's would be on the GPU)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_model.name_or_path)
    engine = Engine(model_and_tokenizer=(hf_model, tok), device="meta", max_batch_size=2)
    try:
        assert engine.batch.pos.device == engine.runner.device == torch.device("cpu")
        out = _gen(engine, max_new_tokens=3, ignore_eos=True)
        assert len(out.outputs[0].output_ids) == 3
    finally:
        engine.shutdown()
