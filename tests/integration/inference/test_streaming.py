"""`stream=true` and several prompts per request, through the official `openai` SDK."""

from __future__ import annotations

import time
from collections import defaultdict

import httpx
import openai
import pytest

from nexrl.inference.engine import Engine
from nexrl.inference.process_engine import ProcessEngine
from nexrl.inference.protocol import GenerationRequest, SamplingParams
from nexrl.inference.server import create_app

from .conftest import API_KEY, ServerThread


@pytest.fixture(scope="module")
def sdk(server, api_key):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0)


def collect(chunks):
    """Per choice index: streamed text, token ids, logprobs, finish reason; and the usage."""
    text, ids, lps, finish, usage = defaultdict(str), defaultdict(list), defaultdict(list), {}, None
    for chunk in chunks:
        body = chunk.model_dump()
        usage = body.get("usage") or usage
        for c in body["choices"]:
            i = c["index"]
            text[i] += c.get("text") or (c.get("delta") or {}).get("content") or ""
            ids[i] += c["token_ids"]
            lp = c.get("logprobs") or {}
            lps[i] += lp.get("token_logprobs") or [x["logprob"] for x in lp.get("content") or []]
            if c["finish_reason"] is not None:
                finish[i] = c["finish_reason"]
    return text, ids, lps, finish, usage


def test_streamed_completion_equals_the_plain_one(sdk):
    kwargs = dict(model="default", prompt="hello", max_tokens=8, n=2, seed=3, logprobs=0)
    kwargs["extra_body"] = {"ignore_eos": True}
    plain = sdk.completions.create(**kwargs).model_dump()["choices"]
    text, ids, lps, finish, _ = collect(sdk.completions.create(stream=True, **kwargs))
    for c in plain:
        i = c["index"]
        assert ids[i] == c["token_ids"] and len(ids[i]) == 8
        assert text[i] == c["text"]
        assert lps[i] == pytest.approx(c["logprobs"]["token_logprobs"])
        assert finish[i] == "length"


def test_streamed_text_stops_before_the_stop_string(sdk):
    kwargs = dict(model="default", prompt=[10, 11, 12], max_tokens=12, temperature=0)
    greedy = sdk.completions.create(**kwargs).model_dump()["choices"][0]["text"]
    stop = greedy[4:6]
    text, _, _, finish, _ = collect(sdk.completions.create(stream=True, stop=[stop], **kwargs))
    assert text[0] == greedy[: greedy.find(stop)]
    assert finish[0] == "stop"


def test_streamed_chat_with_usage(sdk):
    messages = [{"role": "user", "content": "abc"}]
    kwargs = dict(model="default", messages=messages, max_tokens=6, temperature=0)
    plain = sdk.chat.completions.create(**kwargs).model_dump()
    chunks = list(
        sdk.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    first = chunks[0].model_dump()["choices"][0]["delta"]
    assert first["role"] == "assistant"
    text, ids, _, finish, usage = collect(chunks)
    assert text[0] == plain["choices"][0]["message"]["content"]
    assert ids[0] == plain["choices"][0]["token_ids"]
    assert finish[0] == plain["choices"][0]["finish_reason"]
    assert usage["completion_tokens"] == plain["usage"]["completion_tokens"]


def test_several_prompts_in_one_request(sdk):
    prompts = ["ab", "cde"]
    kwargs = dict(model="default", max_tokens=5, temperature=0, n=2)
    batch = sdk.completions.create(prompt=prompts, **kwargs).model_dump()
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    for k, prompt in enumerate(prompts):
        alone = sdk.completions.create(prompt=prompt, **kwargs).model_dump()["choices"]
        got = batch["choices"][2 * k : 2 * k + 2]
        assert [c["token_ids"] for c in got] == [c["token_ids"] for c in alone]
    assert len(batch["prompt_token_ids"]) == 2
    assert batch["usage"]["completion_tokens"] == 20


def test_disconnected_stream_frees_its_rows(tiny_path):
    """A client that goes away mid-stream aborts its request (else it runs ~10 s)."""
    engine = Engine(tiny_path, max_batch_size=4, emulated_step_latency_s=0.05)
    body = {"model": "default", "prompt": "ab", "max_tokens": 200, "stream": True}
    body["ignore_eos"] = True
    try:
        with ServerThread(create_app(engine, api_key=API_KEY)) as srv:
            headers = {"Authorization": f"Bearer {API_KEY}"}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, headers=headers) as r:
                assert r.status_code == 200
                next(r.iter_lines())  # the first token arrived; now hang up
            deadline = time.monotonic() + 5
            while engine.stats["running"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert engine.stats["running"] == 0
            assert engine.stats["generated_tokens"] < 150
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_process_engine_streams_every_token(tiny_path):
    eng = ProcessEngine(tiny_path, max_batch_size=4, threads=1)
    seen = defaultdict(list)
    try:
        req = GenerationRequest([5, 6], SamplingParams(max_new_tokens=7, n=2, ignore_eos=True))
        resp = eng.submit(req, on_token=lambda i, tok, lp, v: seen[i].append((tok, lp))).result()
        for i, out in enumerate(resp.outputs):
            assert [t for t, _ in seen[i]] == out.output_ids
            assert [lp for _, lp in seen[i]] == pytest.approx(out.output_logprobs)
    finally:
        eng.shutdown()


def test_stream_on_an_engine_that_cannot_stream_is_a_400(tiny_path):
    from nexrl.inference.hf_engine import HFEngine

    engine = HFEngine(tiny_path)
    try:
        with ServerThread(create_app(engine, api_key=API_KEY)) as srv:
            body = {"model": "default", "prompt": "hi", "max_tokens": 2, "stream": True}
            headers = {"Authorization": f"Bearer {API_KEY}"}
            r = httpx.post(srv.url + "/v1/completions", json=body, headers=headers, timeout=30)
    finally:
        engine.shutdown()
    assert r.status_code == 400
    assert "stream=true: HFEngine cannot stream tokens" in r.text
