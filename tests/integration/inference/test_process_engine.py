"""`ProcessEngine`: the engine in a child process behaves like the in-process one."""

from __future__ import annotations

import pytest

from nexrl.inference.engine import Engine
from nexrl.inference.process_engine import ProcessEngine
from nexrl.inference.protocol import GenerationRequest, SamplingParams, WeightUpdateMeta


@pytest.mark.slow
def test_process_engine_matches_in_process(tiny_path, other_weights_path):
    req = GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=12, n=2, seed=4))
    local = Engine(tiny_path, max_batch_size=4)
    expected = local.generate(req)
    local.shutdown()
    eng = ProcessEngine(tiny_path, max_batch_size=4, threads=1)
    try:
        got = eng.generate(
            GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=12, n=2, seed=4))
        )
        assert [o.output_ids for o in got.outputs] == [o.output_ids for o in expected.outputs]
        assert got.outputs[0].output_logprobs == pytest.approx(expected.outputs[0].output_logprobs)
        with pytest.raises(ValueError, match="max_new_tokens"):
            eng.generate(GenerationRequest([5], SamplingParams(max_new_tokens=-1)))
        eng.update_weights(WeightUpdateMeta(version=1, path=str(other_weights_path)))
        with pytest.raises(ValueError, match="no path or state_dict"):
            eng.update_weights(WeightUpdateMeta(version=2))
        after = eng.generate(GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=3)))
        assert eng.version == 1 and after.outputs[0].output_versions == [1] * len(
            after.outputs[0].output_ids
        )
        turn1 = list(range(9, 29))  # a reply left out of the child's prefix cache
        one = GenerationRequest(turn1, SamplingParams(max_new_tokens=3), cache_output=False)
        reply = eng.generate(one).outputs[0].output_ids
        hits = eng.stats["prefix_hit_tokens"]
        eng.generate(GenerationRequest([*turn1, *reply, 13], SamplingParams(max_new_tokens=1)))
        assert eng.stats["prefix_hit_tokens"] - hits == len(turn1)  # the prompt only
        eng.pause()
        eng.resume()
        assert eng.stats["requests"] >= 2 and eng.health()
    finally:
        eng.shutdown()
    assert not eng.health()
