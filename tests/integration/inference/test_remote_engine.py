"""RemoteBackend is an InferenceEngine: token ids in, ids, logprobs and versions out."""

from __future__ import annotations

import asyncio

from nexrl.inference.protocol import GenerationRequest, InferenceEngine, SamplingParams
from nexrl.inference.remote import RemoteBackend


def test_remote_backend_is_an_inference_engine(server, api_key, engine, tiny_path):
    remote = RemoteBackend(
        {"backend": "remote", "url": server.url, "api_key": api_key, "model": tiny_path}
    )
    assert isinstance(remote, InferenceEngine)
    request = GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=4, temperature=0, n=2))
    out = remote.generate(request)
    local = engine.generate(request)
    assert out.input_ids == [5, 6, 7] and len(out.outputs) == 2
    assert out.outputs[0].output_ids == local.outputs[0].output_ids  # greedy: same tokens
    for got, want in zip(
        out.outputs[0].output_logprobs, local.outputs[0].output_logprobs, strict=True
    ):
        assert abs(got - want) < 1e-4
    assert out.outputs[0].output_versions == [remote.version] * len(out.outputs[0].output_ids)
    again = asyncio.run(remote.agenerate(request))
    assert again.outputs[0].output_ids == out.outputs[0].output_ids
    assert remote.health()
    remote.shutdown()
