"""GPU weight sync into vLLM (`vllm_control.GPUWeightPush`): the trainer's module goes to
a managed server through vLLM's weight-transfer engine, CUDA IPC on the one GPU both
share. The push is proven twice: vLLM's checksums of the served weights equal those of
the same weights loaded from files (the CPU path), and the served logprobs of fixed ids
equal the trainer's forward. Needs a CUDA GPU (skipped without one)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from nexrl.inference.client import LLMServiceClient
from tests.integration.vllm.test_vllm_backend import (
    PROMPT,
    forward_logprobs,
    hf_model,
    perturbed_weights,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def checksums(http: httpx.Client) -> dict[str, str]:
    resp = http.post("/weight_checker", json={"action": "checksum"})
    resp.raise_for_status()
    return resp.json()["checksums"]


def test_ipc_push_serves_the_trained_weights_and_its_version(tiny_model_path, tmp_path):
    from nexrl.inference.vllm_control import GPUWeightPush, VLLMControl
    from nexrl.inference.vllm_server import VLLMServer

    options = {
        "max_model_len": 256,
        "max_batch_size": 8,
        "gpu_memory_utilization": 0.2,
        "extra_args": ["--weight-transfer-config", json.dumps({"backend": "ipc"})],
    }
    server = VLLMServer(tiny_model_path, options, tmp_path / "vllm.log")
    server.start()
    try:
        trained = perturbed_weights(tiny_model_path, tmp_path / "w").cuda()
        with httpx.Client(base_url=server.url, timeout=300) as http:
            control = VLLMControl(http)
            base = checksums(http)
            push = GPUWeightPush(server.url, trained, backend="ipc")
            push.push(7)
            assert control.version() == 7
            pushed = checksums(http)
            assert pushed != base  # the served weights changed
            control.load(str(tmp_path / "w"), 8)  # the same weights through files
            assert checksums(http) == pushed
            push.push(9)  # a second push on the same engine
            assert control.version() == 9 and checksums(http) == pushed
            push.close()
        config = {"backend": "vllm", "url": server.url, "model": server.model}
        out = LLMServiceClient(config).completion(prompt_ids=PROMPT, max_tokens=8, temperature=0)
        want = forward_logprobs(trained, PROMPT, out["response_ids"])
        got = torch.tensor(out["response_logprobs"])
        assert (got - want).abs().max() < 1e-3  # the served weights are the trained ones
        old = forward_logprobs(hf_model(tiny_model_path).cuda(), PROMPT, out["response_ids"])
        assert (got - old).abs().max() > 1e-2  # and no longer the base ones
    finally:
        server.stop()
