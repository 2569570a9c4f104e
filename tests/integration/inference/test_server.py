"""nexrl's server driven by the official `openai` SDK and raw HTTP."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from nexrl.inference.client import LLMServiceClient
from nexrl.inference.protocol import WeightUpdateMeta


@pytest.fixture(scope="module")
def sdk(server, api_key):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0)


@pytest.fixture(scope="module")
def http(server, api_key):
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {api_key}"})


def test_completion_with_logprobs_and_ids(sdk, engine):
    resp = sdk.completions.create(
        model="default",
        prompt="hello",
        max_tokens=8,
        logprobs=0,
        n=3,
        seed=1,
        extra_body={"ignore_eos": True},
    ).model_dump()
    assert len(resp["choices"]) == 3
    prompt_ids = engine.tokenizer("hello")["input_ids"]  # BOS added, as vLLM does
    assert resp["prompt_token_ids"] == prompt_ids
    for c in resp["choices"]:
        assert len(c["token_ids"]) == 8 == len(c["logprobs"]["token_logprobs"])
        assert c["text"] == engine.tokenizer.decode(c["token_ids"], skip_special_tokens=True)
        assert c["finish_reason"] == "length"
    assert resp["weight_version"] == engine.version
    assert resp["usage"]["completion_tokens"] == 24


def test_token_ids_prompt_and_stop(sdk):
    greedy = sdk.completions.create(
        model="default", prompt=[10, 11, 12], max_tokens=10, temperature=0
    ).model_dump()["choices"][0]
    stop = greedy["text"][3:5]
    cut = sdk.completions.create(
        model="default", prompt=[10, 11, 12], max_tokens=10, temperature=0, stop=[stop]
    ).model_dump()["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == greedy["text"][: greedy["text"].find(stop)]


def test_chat_uses_template(sdk, engine):
    msgs = [{"role": "user", "content": "hi"}]
    resp = sdk.chat.completions.create(
        model="default", messages=msgs, max_tokens=6, logprobs=True, temperature=0
    ).model_dump()
    ids = engine.tokenizer.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert resp["prompt_token_ids"] == list(ids)
    choice = resp["choices"][0]
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    assert choice["message"]["role"] == "assistant"


def test_models_health_metrics(http, sdk):
    assert [m.id for m in sdk.models.list().data] == ["default"]
    assert http.get("/health").json()["status"] == "ok"
    text = http.get("/metrics").text
    for name in (
        "nexrl_requests_total",
        "nexrl_generated_tokens_total",
        "nexrl_tokens_per_second",
        "nexrl_batch_occupancy",
        "nexrl_queue_length",
    ):
        assert name in text


def test_concurrent_clients(sdk):
    def one(i):
        return sdk.completions.create(model="default", prompt=f"q{i}", max_tokens=12)

    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(one, range(16)))
    assert all(len(o.choices) == 1 for o in outs)


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ({"model": "nope", "prompt": "x"}, 404, "model 'nope' not found"),
        ({"model": "default", "prompt": "x", "max_tokens": -1}, 400, "max_new_tokens"),
        ({"model": "default", "prompt": "x" * 300}, 400, "max_model_len"),
        ({"model": "default", "prompt": [5, 1000]}, 400, "outside the vocabulary"),
        ({"prompt": "x"}, 400, "model"),
        ({"model": "default", "prompt": "x" * 300, "stream": True}, 400, "max_model_len"),
        ({"model": "default", "prompt": ["a", "b"], "stream": True}, 400, "one prompt"),
        ({"model": "default", "prompt": []}, 400, "empty"),
    ],
)
def test_bad_requests_are_4xx_and_server_survives(http, body, status, needle):
    r = http.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    assert http.get("/health").status_code == 200


def test_malformed_json_and_auth(http, server):
    r = http.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    for path in ("/health", "/v1/models", "/metrics"):
        assert httpx.get(server.url + path).status_code == 401
    bad = httpx.post(server.url + "/pause_generation", headers={"Authorization": "Bearer wrong"})
    assert bad.status_code == 401


def test_client_remote_weight_update_and_abort(server, engine, other_weights_path, api_key):
    cfg = {"backend": "remote", "url": server.url, "api_key": api_key, "model": engine.model_path}
    client = LLMServiceClient(cfg)
    before = client.completion(prompt_ids=[5, 6, 7], max_tokens=10, temperature=0)
    assert before["prompt_ids"] == [5, 6, 7] and not before["retokenized"]
    v = engine.version
    client.update_weights(WeightUpdateMeta(version=v + 1, path=str(other_weights_path)))
    after = client.completion(prompt_ids=[5, 6, 7], max_tokens=10, temperature=0)
    assert engine.version == v + 1 == after["model_version"] == client.version
    assert after["token_versions"] == [v + 1] * len(after["response_ids"])
    assert after["response_logprobs"] != pytest.approx(before["response_logprobs"], abs=1e-3)
    # abort by rid through the control endpoint returns the partial sample
    client.pause()
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(
            client.completion, prompt_ids=[5, 6], max_tokens=200, rid="slow", ignore_eos=True
        )
        time.sleep(0.3)
        client.abort("slow")
        out = fut.result(timeout=30)
    client.resume()
    assert out["finish_reason"] == "abort"
    chat = client.generate([{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat["messages"][0]["content"] == "hi" and len(chat["response_ids"]) <= 4


def test_remote_client_retries_then_raises_connection_error(tiny_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed
    cfg = {
        "backend": "remote",
        "url": dead,
        "max_retries": 2,
        "served_model_name": "default",
        "model": str(tiny_path),
        "timeout": 5,
    }
    client = LLMServiceClient(cfg)
    calls = []
    real = client._remote.completion
    client._remote.completion = lambda *a: (calls.append(1), real(*a))[1]
    with pytest.raises(ConnectionError, match=f"{dead} did not answer after 2 tries"):
        client.completion("x", max_tokens=1)
    assert len(calls) == 3  # first try + max_retries


def test_remote_bad_request_is_not_retried(server, api_key):
    cfg = {"backend": "remote", "url": server.url + "/v1", "api_key": api_key, "max_retries": 3}
    client = LLMServiceClient(cfg)
    with pytest.raises(openai.BadRequestError, match="max_new_tokens"):
        client.completion(prompt_ids=[5], max_tokens=-2)
