"""A managed vLLM server that dies is restarted on its port with the last push (runs last:
it restarts the session's server)."""

from __future__ import annotations

import httpx
import pytest
import torch

from nexrl.inference.client import LLMServiceClient
from nexrl.inference.protocol import WeightUpdateMeta
from nexrl.inference.vllm_control import VLLMControl
from tests.integration.vllm.test_vllm_backend import PROMPT, forward_logprobs, perturbed_weights

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]  # a start: 30 s-10 min


def test_a_dead_server_comes_back_with_the_last_push(vllm_server, tiny_model_path, tmp_path):
    trained = perturbed_weights(tiny_model_path, tmp_path / "w")
    with httpx.Client(base_url=vllm_server.url, timeout=300) as http:
        VLLMControl(http, vllm_server).update_weights(
            WeightUpdateMeta(version=7, path=str(tmp_path / "w"))
        )
    url, pid = vllm_server.url, vllm_server.proc.pid
    vllm_server.proc.kill()
    vllm_server.proc.wait()
    config = {"backend": "vllm", "url": url, "model": vllm_server.model, "timeout": 1800}
    client = LLMServiceClient(config)
    client._remote.server = vllm_server  # as a managed client: requests wait for the restart
    out = client.completion(prompt_ids=PROMPT, max_tokens=6, temperature=0)
    assert vllm_server.restarts == 1 and vllm_server.proc.pid != pid and vllm_server.url == url
    assert out["model_version"] == 7 and client.version == 7
    want = forward_logprobs(trained, PROMPT, out["response_ids"])
    assert (torch.tensor(out["response_logprobs"]) - want).abs().max() < 1e-3
