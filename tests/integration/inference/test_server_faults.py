"""Hostile numbers and failures that must stay with one request (docs/reliability.md,
"Hostile input"): out-of-range integers and non-finite floats are 4xx naming the field;
a request that fails in prefill fails alone, in the in-process engine and behind
`ProcessEngine`'s feeder thread; a disconnected client's work is aborted; `/docs`
follows the API key; a failed weight update and a SIGTERM leave no temp folder."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import wait
from pathlib import Path

import httpx
import pytest

from nexrl.inference.engine import Engine
from nexrl.inference.process_engine import ProcessEngine
from nexrl.inference.protocol import GenerationRequest, SamplingParams, WeightUpdateMeta
from nexrl.inference.server import create_app
from tests.integration.inference.conftest import ServerThread

BIG = 2**64


def completion(**fields):
    return {"model": "default", "prompt": "hi", "max_tokens": 2, **fields}


HOSTILE = {
    "seed of 2^64": (completion(seed=BIG), "seed"),
    "seed of -2^64": (completion(seed=-BIG), "seed"),
    "top_k of 2^64": (completion(top_k=BIG), "top_k"),
    "top_k of -5": (completion(top_k=-5), "top_k"),
    "stop token id of 2^64": (completion(stop_token_ids=[BIG]), "stop_token_ids.0"),
    "negative stop token id": (completion(stop_token_ids=[-1]), "stop_token_ids.0"),
    "max_tokens of 2^64": (completion(max_tokens=BIG), "max_tokens"),
    "n of 2^64": (completion(n=BIG), "n: Input should be less than or equal to"),
    "logprobs of 2^64": (completion(logprobs=BIG), "logprobs"),
}


@pytest.fixture(scope="module")
def served(engine):
    with ServerThread(create_app(engine)) as srv, httpx.Client(base_url=srv.url) as http:
        yield http


@pytest.mark.parametrize("case", list(HOSTILE), ids=list(HOSTILE))
def test_out_of_range_integers_are_4xx_naming_the_field(served, case):
    body, field = HOSTILE[case]
    r = served.post("/v1/completions", json=body)
    assert 400 <= r.status_code < 500, r.text
    assert field in r.json()["error"]["message"]


@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN"])
def test_non_finite_temperature_is_4xx(served, value):
    raw = '{"model": "default", "prompt": "hi", "max_tokens": 2, "temperature": ' + value + "}"
    r = served.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "temperature" in r.json()["error"]["message"]


def test_textual_weight_version_is_4xx(served):
    r = served.post("/update_weights_from_disk", json={"model_path": "/x", "weight_version": "v2"})
    assert r.status_code == 400, r.text
    assert "weight_version" in r.json()["error"]["message"]


def test_seeds_across_the_int64_range_generate(served):
    for seed in (2**44 + 3, 2**62, 2**63 - 1, -(2**63)):
        r = served.post("/v1/completions", json=completion(seed=seed))
        assert r.status_code == 200, (seed, r.text)
    again = served.post("/v1/completions", json=completion(seed=2**63 - 1, temperature=1.0))
    first = served.post("/v1/completions", json=completion(seed=2**63 - 1, temperature=1.0))
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]


def test_docs_follow_the_api_key(engine):
    with ServerThread(create_app(engine, api_key="k")) as srv:
        for path in ("/docs", "/openapi.json"):
            assert httpx.get(srv.url + path).status_code == 401
            ok = httpx.get(srv.url + path, headers={"Authorization": "Bearer k"})
            assert ok.status_code == 200
        assert "/v1/completions" in ok.text  # openapi.json lists the routes
    with ServerThread(create_app(engine)) as srv:  # no key: open, as before
        assert httpx.get(srv.url + "/openapi.json").status_code == 200


def test_a_failed_prefill_fails_only_its_own_request(tiny_path):
    """The in-process engine `nexrl train` uses: 12 plain requests admitted in one prefill
    with one whose token id is outside the vocabulary (the embedding raises there); the
    12 are answered, the bad one alone fails, and the engine serves on. Before, all 13
    were left pending."""
    engine = Engine(tiny_path, max_batch_size=32, gather_quiet_s=0.2, gather_max_s=1.0)
    try:
        params = SamplingParams(max_new_tokens=3)
        good = [engine.submit(GenerationRequest([1, 2, 3], params)) for _ in range(6)]
        bad = engine.submit(GenerationRequest([1, 10**6], params))
        good += [engine.submit(GenerationRequest([1, 2, 3], params)) for _ in range(6)]
        _, pending = wait([*good, bad], timeout=60)
        assert not pending, f"{len(pending)} requests never answered"
        assert all(len(f.result().outputs[0].output_ids) == 3 for f in good)
        with pytest.raises(IndexError):
            bad.result()
        later = engine.generate(GenerationRequest([4, 5], params))
        assert len(later.outputs[0].output_ids) == 3
    finally:
        engine.shutdown()


def test_a_disconnected_client_is_aborted(tiny_path):
    """A client that hangs up mid-generation: its rows stop within a second, not after
    the 200 slow steps it asked for."""
    engine = Engine(tiny_path, max_batch_size=8, emulated_step_latency_s=0.05)
    try:
        with ServerThread(create_app(engine)) as srv:
            body = completion(max_tokens=200, n=4, ignore_eos=True)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(srv.url + "/v1/completions", json=body, timeout=1.0)
            deadline = time.monotonic() + 5
            while engine.stats["running"] and time.monotonic() < deadline:
                time.sleep(0.05)
            steps = engine.stats["steps"]
            assert engine.stats["running"] == 0, "the request kept generating"
            assert steps < 120, f"{steps} steps: the abort came late"
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def process_engine(tiny_path):
    eng = ProcessEngine(tiny_path, max_batch_size=16, max_restarts=0, health_interval_s=0.5)
    yield eng
    eng.shutdown()


def test_hostile_ints_cannot_kill_the_feeder(process_engine):
    """Before: a seed of 2^64 killed the thread that writes to the engine process, every
    later request hung and the watchdog's restarts replayed it until the budget was
    spent. Now each fails alone, before it is sent, and the engine serves on."""
    for field, value in (("seed", BIG), ("top_k", BIG), ("stop_token_ids", [BIG])):
        params = SamplingParams(max_new_tokens=2, **{field: value})
        with pytest.raises(ValueError, match=field):
            process_engine.submit(GenerationRequest([1, 2], params))
    # one that passes validation but not the wire encoder fails alone too
    params = SamplingParams(max_new_tokens=2)
    odd = GenerationRequest([1, 2], params, metadata={"x": BIG})
    fine = [process_engine.submit(GenerationRequest([1, 2], params)) for _ in range(6)]
    with pytest.raises(ValueError, match="cannot encode"):
        process_engine.submit(odd).result(timeout=30)
    assert all(len(f.result(timeout=60).outputs[0].output_ids) == 2 for f in fine)
    assert process_engine.restarts == 0 and process_engine.health()


def test_failed_weight_update_leaves_no_snapshot(process_engine, tmp_path):
    root = process_engine._weights_root
    before = sorted(root.iterdir())
    bad = tmp_path / "not_weights"
    bad.mkdir()
    (bad / "notes.txt").write_text("not a model")
    with pytest.raises((ValueError, FileNotFoundError, KeyError, RuntimeError)):
        process_engine.update_weights(WeightUpdateMeta(version=5, path=str(bad)))
    assert sorted(root.iterdir()) == before
    assert process_engine.version == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weight_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("nexrl-engine-weights-*")}


@pytest.mark.slow
def test_sigterm_removes_the_engine_temp_folder(tiny_path):
    """`nexrl serve` (engine in a child process) stopped by SIGTERM: its snapshot
    folder is gone afterwards (uvicorn re-raises the signal after its shutdown)."""
    before = _weight_dirs()
    port = _free_port()
    cmd = [sys.executable, "-m", "nexrl.cli", "serve", "--model", str(tiny_path)]
    proc = subprocess.Popen([*cmd, "--port", str(port)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        created = _weight_dirs() - before
        assert created, "the server made no weights folder"
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (created & _weight_dirs()), "SIGTERM left the engine's temp folder behind"
