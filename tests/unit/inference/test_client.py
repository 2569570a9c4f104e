"""LLMServiceClient in-process: result contract, chat, weight-sync blocking, shared engines."""

from __future__ import annotations

import threading
import time
import warnings

import pytest

from nexrl.inference.client import (
    LLMServiceClient,
    get_local_engine,
    sampling_from_kwargs,
    shutdown_local_engines,
)
from nexrl.inference.engine import Engine
from nexrl.inference.hf_engine import HFEngine
from nexrl.inference.protocol import WeightUpdateMeta
from tests.fresh import run_fresh

KEYS = {"response", "response_ids", "response_logprobs", "finish_reason", "token_versions"}


@pytest.fixture(scope="module")
def engine(tiny_path):
    eng = Engine(tiny_path, max_batch_size=16)
    yield eng
    eng.shutdown()


def test_completion_result_contract(engine):
    client = LLMServiceClient({"backend": "builtin"}, engine=engine)
    out = client.completion("abc", max_tokens=6, n=2, seed=3, ignore_eos=True)
    assert out["prompt"] == "abc"
    assert out["prompt_ids"] == engine.tokenizer("abc", add_special_tokens=True)["input_ids"]
    assert len(out["choices"]) == 2 and set(out["choices"][0]) >= KEYS
    assert {k: out[k] for k in KEYS} == out["choices"][0]
    assert len(out["response_ids"]) == 6 == len(out["response_logprobs"])
    assert out["model_version"] == 0 and client.version == 0 and client.model_tag == "default"
    ids_out = client.completion(prompt_ids=[5, 6, 7], max_tokens=3)
    assert ids_out["prompt_ids"] == [5, 6, 7] and ids_out["prompt"] is None
    with pytest.raises(ValueError, match="exactly one"):
        client.completion("a", prompt_ids=[1])


def test_chat_applies_template(engine):
    client = LLMServiceClient({"backend": "builtin"}, engine=engine)
    msgs = [{"role": "user", "content": "2+2?"}]
    out = client.generate(msgs, max_tokens=4, temperature=0)
    ids = engine.tokenizer.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert out["prompt_ids"] == list(ids) and out["messages"] == msgs


class _Controller:
    def __init__(self) -> None:
        self.state = "block"
        self.calls: list[str] = []

    def check_rollout_service_status(self, model_tag: str) -> str:
        self.calls.append(model_tag)
        return self.state


def test_weight_sync_blocks_until_released(engine):
    client = LLMServiceClient({"backend": "builtin", "model_tag": "default"}, engine=engine)
    ctl = _Controller()
    client.set_weight_sync_controller(ctl)
    done = threading.Event()
    t = threading.Thread(target=lambda: (client.completion("a", max_tokens=2), done.set()))
    t.start()
    time.sleep(0.2)
    assert not done.is_set() and len(ctl.calls) > 1
    ctl.state = "continue"
    t.join(timeout=30)
    assert done.is_set() and set(ctl.calls) == {"default"}


def test_update_weights_through_client(engine, other_weights_path, tiny_path):
    client = LLMServiceClient({"backend": "builtin"}, engine=engine)
    a = client.completion(prompt_ids=[5, 6], max_tokens=5, temperature=0)
    client.update_weights(WeightUpdateMeta(version=1, path=str(other_weights_path)))
    b = client.completion(prompt_ids=[5, 6], max_tokens=5, temperature=0)
    assert b["model_version"] == 1 and b["token_versions"] == [1] * len(b["response_ids"])
    assert b["response_logprobs"] != pytest.approx(a["response_logprobs"], abs=1e-3)
    client.update_weights(WeightUpdateMeta(version=2, path=str(tiny_path)))
    c = client.completion(prompt_ids=[5, 6], max_tokens=5, temperature=0)
    assert c["response_logprobs"] == pytest.approx(a["response_logprobs"], abs=1e-5)


def test_local_engine_shared_per_tag(tiny_path):
    try:
        cfg = {"backend": "hf", "model": str(tiny_path), "model_tag": "t1"}
        e1, e2 = get_local_engine(cfg), get_local_engine(dict(cfg))
        assert e1 is e2 and isinstance(e1, HFEngine)
        assert LLMServiceClient(cfg)._engine is e1
        out = LLMServiceClient(cfg).completion("hi", max_tokens=3)
        assert len(out["response_ids"]) <= 3
        other = get_local_engine({"backend": "builtin", "model": str(tiny_path), "model_tag": "t2"})
        assert isinstance(other, Engine) and other is not e1
    finally:
        shutdown_local_engines()


def test_a_second_config_for_a_running_tag_is_warned_about(tiny_path):
    """Same tag, other engine options: the client shares the running engine, and says so."""
    try:
        cfg = {"backend": "hf", "model": str(tiny_path), "model_tag": "t3"}
        first = get_local_engine(cfg)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the same settings again: silent
            assert get_local_engine({**cfg, "timeout": 5}) is first  # not an engine option
        with pytest.warns(UserWarning, match=r"model_tag 't3'.*backend='builtin'.*'hf'"):
            assert get_local_engine({**cfg, "backend": "builtin"}) is first
    finally:
        shutdown_local_engines()


def test_sampling_from_kwargs_and_bad_backend():
    p = sampling_from_kwargs({"max_tokens": 7, "stop": "x", "top_k": 5, "n": 2, "seed": 1})
    assert (p.max_new_tokens, p.stop, p.top_k, p.n, p.seed) == (7, ["x"], 5, 2, 1)
    with pytest.raises(ValueError, match="backend"):
        LLMServiceClient({"backend": "tgi"})


def test_a_local_engine_client_never_imports_the_openai_sdk():
    """The HTTP clients' errors are retried only for a remote engine, so a local run
    does not pay the openai SDK's import at start-up."""
    code = (
        "import sys\n"
        "from nexrl.inference.client import LLMServiceClient\n"
        "client = LLMServiceClient({'backend': 'builtin'}, engine=object())\n"
        "assert not client._retryer.retry.predicate(RuntimeError('engine'))\n"
        "assert client._retryer.retry.predicate(ConnectionError('engine'))\n"
        "print('openai' in sys.modules)\n"
    )
    assert run_fresh(code).stdout.strip() == "False"


def test_a_remote_client_retries_the_openai_sdks_transient_errors():
    import httpx
    import openai

    client = LLMServiceClient({"backend": "remote", "url": "http://127.0.0.1:9"})
    retry = client._retryer.retry.predicate
    request = httpx.Request("POST", "http://127.0.0.1:9")
    assert retry(openai.APIConnectionError(request=request))
    assert retry(httpx.ConnectError("refused"))
    assert not retry(ValueError("bad request"))


@pytest.mark.parametrize("max_retries", [0, 1, 3])
def test_transport_errors_are_retried_max_retries_times_with_growing_waits(
    max_retries, monkeypatch
):
    """The first try is a plain call; after it, `max_retries` more, waiting 0.1 s, then
    twice as long each time; a bad request (ValueError) is never retried."""
    sleeps: list[float] = []
    monkeypatch.setattr(time, "sleep", sleeps.append)
    client = LLMServiceClient({"backend": "builtin", "max_retries": max_retries}, engine=object())
    calls: list[int] = []

    def flaky(fail_times: int, error: type[Exception] = ConnectionError) -> str:
        calls.append(1)
        if len(calls) <= fail_times:
            raise error("engine gone")
        return "ok"

    assert client._retrying(flaky, max_retries) == "ok"  # the last allowed try succeeds
    assert len(calls) == max_retries + 1
    assert sleeps == pytest.approx([0.1 * 2**k for k in range(max_retries)])
    calls.clear()
    with pytest.raises(ConnectionError, match="engine gone"):
        client._retrying(flaky, max_retries + 1)
    assert len(calls) == max_retries + 1
    calls.clear()
    with pytest.raises(ValueError):
        client._retrying(flaky, 5, ValueError)
    assert len(calls) == 1
