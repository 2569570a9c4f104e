"""`ClientEngine`: the workflow's engine inside the pipeline is the worker's client, and a
weight push between two turns shows in the trajectory's `token_versions`."""

from __future__ import annotations

import asyncio
import threading

import torch

from nexrl.inference.client import LLMServiceClient
from nexrl.inference.engine import Engine
from nexrl.inference.protocol import WeightUpdateMeta
from nexrl.models.tiny import build_tiny_qwen2
from nexrl.rollout.agent import ClientEngine
from nexrl.rollout.workflow import as_trajectories
from tests.integration.agents.workflows import TwoTurnWorkflow


class PushBetweenTurns(TwoTurnWorkflow):
    """Pushes new weights (version 1) after the first turn."""

    def __init__(self, weights: str) -> None:
        super().__init__()
        self.weights = weights

    async def arun_episode(self, engine, data):
        original = engine.agenerate
        calls = 0

        async def agenerate(request):
            nonlocal calls
            if calls == 1:
                engine.update_weights(WeightUpdateMeta(version=1, path=self.weights))
            calls += 1
            return await original(request)

        engine.agenerate = agenerate
        return await super().arun_episode(engine, data)


def test_push_between_turns_is_visible_per_token(tiny_model_path, tmp_path):
    torch.set_num_threads(1)
    other = str(build_tiny_qwen2(tmp_path / "other", seed=1))
    engine = Engine(tiny_model_path, max_batch_size=4)
    try:
        client = LLMServiceClient({"backend": "builtin"}, engine=engine)
        ce = ClientEngine(client)
        result = asyncio.run(PushBetweenTurns(other).arun_episode(ce, {"prompt": "abc"}))
        (traj,) = as_trajectories(result)
    finally:
        engine.shutdown()
    mask, versions = traj["loss_mask"], traj["token_versions"]
    first_turn = versions[: mask.index(0)]
    second_turn = versions[len(mask) - mask[::-1].index(0) :]
    assert set(first_turn) == {0} and set(second_turn) == {1}
    assert traj["model_version"] == 0  # staleness counts from the oldest policy token
    assert all(v >= 0 for v in versions)  # tool tokens carry the oldest version, not -1
    assert client.recent_samples()[-1]["model_version"] == 1


def test_generations_run_in_the_executor_it_is_given(tiny_model_path):
    """Whichever loop awaits `agenerate` (a proxy server's has asyncio's small default
    executor), the blocking client call runs on the worker's sized executor."""
    from concurrent.futures import ThreadPoolExecutor

    from nexrl.inference.protocol import GenerationRequest, SamplingParams

    engine = Engine(tiny_model_path, max_batch_size=4)
    executor = ThreadPoolExecutor(2, thread_name_prefix="worker-io")
    client = LLMServiceClient({"backend": "builtin"}, engine=engine)
    threads = []
    generate = client.completion

    def completion(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return generate(*args, **kwargs)

    client.completion = completion
    try:
        ce = ClientEngine(client, executor=executor)
        request = GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=2, ignore_eos=True))
        response = asyncio.run(ce.agenerate(request))
    finally:
        engine.shutdown()
        executor.shutdown()
    assert len(response.outputs[0].output_ids) == 2
    assert threads and all(name.startswith("worker-io") for name in threads)
