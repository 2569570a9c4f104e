"""Served-engine faults injected for real: SIGKILL, SIGSTOP (a hang), an address-space limit
(out of memory). Each time the engine process is replaced, gets the last weights and their
version back, and the request that was in flight completes."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import time

import pytest

from nexrl.inference.health import EngineDeadError, EngineRestartedError
from nexrl.inference.process_engine import ProcessEngine
from nexrl.inference.protocol import GenerationRequest, SamplingParams, WeightUpdateMeta

pytestmark = pytest.mark.slow

VERSION = 3


def _engine(model: str, weights: str, tmp_path, **options) -> ProcessEngine:
    export = tmp_path / "sync_weights"  # the trainer's export folder
    shutil.copytree(weights, export)
    eng = ProcessEngine(
        model,
        max_batch_size=4,
        threads=1,
        emulated_step_latency_s=0.02,  # ~1 s per 48-token request: long enough to hit
        health_interval_s=0.2,
        health_timeout_s=3.0,
        **options,
    )
    eng.update_weights(WeightUpdateMeta(version=VERSION, path=str(export)))
    shutil.rmtree(export)  # the trainer rewrote its export: the engine keeps its snapshot
    return eng


@pytest.fixture
def engine(tiny_model_path, other_weights_path, tmp_path):
    eng = _engine(tiny_model_path, other_weights_path, tmp_path)
    yield eng
    eng.shutdown()


def _request(tokens: int = 48) -> GenerationRequest:
    return GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=tokens, ignore_eos=True))


def _wait_restarts(eng: ProcessEngine, n: int, limit: float = 120.0) -> None:
    end = time.monotonic() + limit
    while eng.restarts < n:
        assert time.monotonic() < end, f"no restart within {limit} s"
        time.sleep(0.05)


def _assert_served_at_current_version(response) -> None:
    out = response.outputs[0]
    assert len(out.output_ids) == 48
    assert out.output_versions == [VERSION] * 48  # the restarted engine got the weights back


def _in_flight(eng: ProcessEngine):
    future = eng.submit(_request())
    time.sleep(0.3)  # the request is being decoded
    assert not future.done()
    return future


def test_killed_engine_restarts_and_replays_the_request_in_flight(engine):
    pid = engine.pid
    future = _in_flight(engine)
    os.kill(pid, signal.SIGKILL)
    _assert_served_at_current_version(future.result(timeout=120))
    assert engine.restarts == 1 and engine.pid != pid
    assert "SIGKILL" in engine.restart_reasons[0]
    _assert_served_at_current_version(engine.generate(_request()))
    assert engine.health() and engine.version == VERSION


def test_hung_engine_is_detected_by_the_health_check_and_replaced(engine):
    pid = engine.pid
    future = _in_flight(engine)
    os.kill(pid, signal.SIGSTOP)
    _assert_served_at_current_version(future.result(timeout=120))
    assert engine.restarts == 1 and "hung" in engine.restart_reasons[0]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the stopped process was killed, not left behind


def test_hang_with_a_full_pipe_is_detected_and_every_request_served(engine):
    """A stopped engine stops reading its pipe; 300 long prompts fill it. Callers must not
    block, the health check must still fire, and every request is served afterwards."""
    pid = engine.pid
    os.kill(pid, signal.SIGSTOP)
    prompt = list(range(5, 25)) * 10  # 200 tokens: ~300 messages overflow a 64 KiB pipe
    futures = [
        engine.submit(GenerationRequest(prompt, SamplingParams(max_new_tokens=2, ignore_eos=True)))
        for _ in range(300)
    ]  # returns at once although nothing can be written
    for future in futures:
        assert future.result(timeout=300).outputs[0].output_versions == [VERSION] * 2
    assert engine.restarts == 1 and "hung" in engine.restart_reasons[0]


def test_engine_out_of_memory_during_a_weight_update_is_restarted(
    engine, tiny_model_path, tmp_path
):
    """The address space of the engine process is capped at what it uses now, so loading
    the next weights fails for lack of memory; the replacement loads them."""
    pid = engine.pid
    with open(f"/proc/{pid}/status") as f:
        vm_size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
    _, hard = resource.prlimit(pid, resource.RLIMIT_AS)
    resource.prlimit(pid, resource.RLIMIT_AS, (vm_size, hard))  # no room for anything new
    export = tmp_path / "next_weights"
    shutil.copytree(tiny_model_path, export)
    engine.update_weights(WeightUpdateMeta(version=VERSION + 1, path=str(export)))
    assert engine.restarts == 1 and "out of memory" in engine.restart_reasons[0]
    assert engine.pid != pid and engine.version == VERSION + 1
    out = engine.generate(_request(8)).outputs[0]
    assert out.output_versions == [VERSION + 1] * 8


def test_streamed_request_fails_retryable_and_a_crash_loop_stops(
    tiny_model_path, other_weights_path
):
    eng = ProcessEngine(
        tiny_model_path,
        max_batch_size=4,
        threads=1,
        emulated_step_latency_s=0.02,
        health_interval_s=0.2,
        max_restarts=1,
    )
    try:
        tokens: list[int] = []
        future = eng.submit(_request(), on_token=lambda *t: tokens.append(t[1]))
        end = time.monotonic() + 60
        while not tokens:  # tokens already reached the caller: no transparent replay
            assert time.monotonic() < end
            time.sleep(0.01)
        os.kill(eng.pid, signal.SIGKILL)
        with pytest.raises(EngineRestartedError, match="SIGKILL"):
            future.result(timeout=120)
        _wait_restarts(eng, 1)
        os.kill(eng.pid, signal.SIGKILL)  # a second crash spends the budget of 1
        _wait_dead(eng)
        with pytest.raises(EngineDeadError, match="restart budget spent"):
            eng.generate(_request())
    finally:
        eng.shutdown()


def _wait_dead(eng: ProcessEngine, limit: float = 60.0) -> None:
    end = time.monotonic() + limit
    while eng.health():
        assert time.monotonic() < end, "the engine was not given up"
        time.sleep(0.05)
