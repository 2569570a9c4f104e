"""backend vllm against a real vLLM server: token ids in, ids, logprobs, versions out;
abort, pause (keep) and weight pushes proven by the served logprobs of fixed ids."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from nexrl.inference.client import LLMServiceClient
from nexrl.inference.protocol import GenerationRequest, SamplingParams, WeightUpdateMeta
from nexrl.inference.remote import RemoteBackend

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]  # a start: 30 s-10 min

PROMPT = [1, 5, 9, 12, 7, 3]


def forward_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The trainer's view: log_softmax of the logits at each response position."""
    ids = torch.tensor([prompt + response], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0].cpu()


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_token_ids_logprobs_n_and_stop(vllm_config, tiny_model_path):
    remote = RemoteBackend(vllm_config)
    out = remote.generate(
        GenerationRequest(PROMPT, SamplingParams(max_new_tokens=6, temperature=0.0, n=2))
    )
    assert out.input_ids == PROMPT and len(out.outputs) == 2
    first, second = out.outputs
    assert first.output_ids == second.output_ids  # greedy, n > 1 (sent as 2 prompts)
    assert len(first.output_logprobs) == len(first.output_ids) == 6
    assert first.output_versions == [0] * 6 and first.finish_reason == "length"
    want = forward_logprobs(hf_model(tiny_model_path), PROMPT, first.output_ids)
    got = torch.tensor(first.output_logprobs)
    assert (got - want).abs().max() < 1e-3, (got, want)
    sampled = remote.generate(
        GenerationRequest(PROMPT, SamplingParams(max_new_tokens=5, temperature=1.0, n=3, seed=1))
    )
    assert len(sampled.outputs) == 3 and all(len(o.output_ids) == 5 for o in sampled.outputs)
    stop_at = first.output_ids[2]
    stopped = remote.generate(
        GenerationRequest(
            PROMPT, SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=[stop_at])
        )
    )
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].output_ids[-1] == stop_at
    remote.shutdown()


def long_request(client, rid: str, out: dict, wait_s: float) -> threading.Thread:
    def run() -> None:
        out[rid] = client.completion(
            prompt_ids=PROMPT, max_tokens=200, temperature=1.0, ignore_eos=True, rid=rid
        )

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(wait_s)
    return thread


def aborted(client, rid: str, abort_all: bool) -> dict:
    """Abort a 200-token request mid-way. The tiny model on an idle machine may finish
    it before the abort lands: try sooner (the abort must win at least once)."""
    out: dict = {}
    for i, wait_s in enumerate((1.0, 0.3, 0.1, 0.03)):
        name = f"{rid}-{i}"
        thread = long_request(client, name, out, wait_s)
        client.abort() if abort_all else client.abort(name)
        thread.join(60)
        if out[name]["finish_reason"] == "abort":
            return out[name]
        assert out[name]["finish_reason"] == "length"  # it finished before the abort
    raise AssertionError("no abort landed before its request finished")


def test_abort_returns_the_tokens_sampled_so_far(vllm_config):
    client = LLMServiceClient(vllm_config)
    one = aborted(client, "one", abort_all=False)
    assert 0 <= len(one["response_ids"]) < 200
    assert len(one["response_logprobs"]) == len(one["response_ids"])
    assert aborted(client, "two", abort_all=True)["finish_reason"] == "abort"


def perturbed_weights(tiny_model_path, into) -> torch.nn.Module:
    """The tiny model with every weight changed, saved as a safetensors directory."""
    model = hf_model(tiny_model_path)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(str(into), safe_serialization=True)
    return model


def test_a_push_serves_the_trained_weights_and_its_version(vllm_config, tiny_model_path, tmp_path):
    client = LLMServiceClient(vllm_config)
    trained = perturbed_weights(tiny_model_path, tmp_path / "w")
    before = client.completion(prompt_ids=PROMPT, max_tokens=8, temperature=0)
    client.update_weights(WeightUpdateMeta(version=5, path=str(tmp_path / "w")))
    assert client.version == 5
    after = client.completion(prompt_ids=PROMPT, max_tokens=8, temperature=0)
    assert after["model_version"] == 5 and after["token_versions"] == [5] * 8
    want = forward_logprobs(trained, PROMPT, after["response_ids"])
    got = torch.tensor(after["response_logprobs"])
    assert (got - want).abs().max() < 1e-3  # the served weights are the trained ones
    old = forward_logprobs(hf_model(tiny_model_path), PROMPT, after["response_ids"])
    assert (got - old).abs().max() > 1e-2  # and no longer the base ones
    assert before["response_logprobs"] != after["response_logprobs"]


def test_a_push_under_paused_requests_lets_them_finish_on_new_weights(
    vllm_config, tiny_model_path, tmp_path
):
    client = LLMServiceClient(vllm_config)
    perturbed_weights(tiny_model_path, tmp_path / "w")
    out: dict = {}
    for i, wait_s in enumerate((0.5, 0.2, 0.05, 0.01)):
        thread = long_request(client, f"kept-{i}", out, wait_s)
        client.pause()
        in_flight = thread.is_alive()  # the pause caught the request mid-way
        if not in_flight:
            client.resume()
            continue
        client.update_weights(WeightUpdateMeta(version=2, path=str(tmp_path / "w")))
        client.resume()
        thread.join(120)
        break
    else:
        raise AssertionError("every request finished before the pause landed")
    result = out[f"kept-{i}"]
    assert result["finish_reason"] == "length" and len(result["response_ids"]) == 200
    # started on version 0: vLLM reports no per-token version, so the older one counts
    assert result["model_version"] == 0 and client.version == 2


def test_engine_options_are_checked():
    with pytest.raises(ValueError, match="engine.kv_heads: not an option of backend vllm"):
        LLMServiceClient({"backend": "vllm", "url": "http://127.0.0.1:9", "kv_heads": 2})
