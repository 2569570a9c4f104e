"""The engine's gather window: a burst of requests reaching an idle engine shares one
prefill; the window never holds back a full batch, a command or a lone request for
longer than `gather_max_s`; the options reach the engine from a run's config."""

from __future__ import annotations

import threading
import time

import pytest

from nexrl.inference.client import LLMServiceClient
from nexrl.inference.engine import Engine
from nexrl.inference.factory import build_local_engine
from nexrl.inference.protocol import GenerationRequest, SamplingParams

PROMPT = [5, 6, 7, 8, 9]


def _request(n: int = 1) -> GenerationRequest:
    return GenerationRequest(list(PROMPT), SamplingParams(max_new_tokens=2, n=n, ignore_eos=True))


def _count_prefills(engine: Engine) -> list[int]:
    calls: list[int] = []
    prefill = engine.runner.prefill

    def counted(tokens, *args):
        calls.append(int(tokens.shape[0]))  # prompts in this prefill
        return prefill(tokens, *args)

    engine.runner.prefill = counted
    return calls


def _trickle(engine: Engine, gap_s: float, count: int = 3) -> None:
    futures = []
    for i in range(count):
        if i:
            time.sleep(gap_s)
        futures.append(engine.submit(_request()))
    for f in futures:
        f.result(timeout=30)


@pytest.fixture
def make_engine(tiny_path):
    engines: list[Engine] = []

    def make(**options) -> Engine:
        engines.append(Engine(tiny_path, max_batch_size=8, **options))
        return engines[-1]

    yield make
    for e in engines:
        e.shutdown()


def test_a_burst_reaching_an_idle_engine_shares_one_prefill(make_engine):
    engine = make_engine(gather_quiet_s=0.5, gather_max_s=5.0)
    calls = _count_prefills(engine)
    _trickle(engine, gap_s=0.05)
    assert calls == [3]


def test_without_the_window_requests_trickle_in_one_prefill_each(make_engine):
    engine = make_engine(gather_quiet_s=0.0)
    calls = _count_prefills(engine)
    _trickle(engine, gap_s=0.5)
    assert calls == [1, 1, 1]


def test_the_window_closes_at_gather_max_s(make_engine):
    engine = make_engine(gather_quiet_s=0.3, gather_max_s=0.2)
    calls = _count_prefills(engine)
    _trickle(engine, gap_s=0.1, count=5)  # arrivals keep coming: the cap ends the wait
    assert len(calls) > 1 and sum(calls) == 5


def test_arrivals_that_fill_the_free_slots_start_at_once(make_engine):
    engine = make_engine(gather_quiet_s=30.0, gather_max_s=60.0)
    t0 = time.monotonic()
    out = engine.submit(_request(n=8)).result(timeout=20)  # 8 rows = max_batch_size
    assert len(out.outputs) == 8
    assert time.monotonic() - t0 < 15.0  # far below the 30 s quiet window


def test_a_command_ends_the_window(make_engine):
    engine = make_engine(gather_quiet_s=30.0, gather_max_s=60.0)
    future = engine.submit(_request())
    time.sleep(0.1)  # the engine is now gathering
    done = threading.Event()
    threading.Thread(target=lambda: (engine.pause(), done.set()), daemon=True).start()
    assert done.wait(15.0)  # pause returned long before the window would close
    engine.resume()
    assert future.result(timeout=60).outputs[0].finish_reason == "length"


def test_negative_windows_are_rejected(tiny_path):
    with pytest.raises(ValueError, match="gather_quiet_s"):
        Engine(tiny_path, max_batch_size=4, gather_quiet_s=-1.0)


def test_the_options_reach_the_engine_from_the_config(tiny_path):
    engine = build_local_engine(
        {"model": str(tiny_path), "max_batch_size": 4, "gather_quiet_s": 0.0, "gather_max_s": 0.5}
    )
    try:
        assert (engine.gather_quiet_s, engine.gather_max_s) == (0.0, 0.5)
    finally:
        engine.shutdown()


def test_an_unknown_engine_option_names_its_key(tiny_path):
    config = {"backend": "builtin", "model": str(tiny_path), "engine": {"gather_ms": 5}}
    with pytest.raises(ValueError, match=r"service\.inference_service\.engine\.gather_ms"):
        LLMServiceClient(config)
