"""Groups are formed by episode, in the advantages too: an agent episode whose two turns did
not merge (SmolLM2's template renders a tool call as an empty turn) makes two
trajectories, and its group's mean and std still count it once; both trajectories get
the episode's advantage. Real agent worker, engine, pool and processor."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from nexrl import AgentRolloutWorker, RolloutWorkflow
from nexrl.algorithms.processor import GRPOProcessor, ProcessorContext
from nexrl.config.schema import AlgorithmConfig, RolloutWorkerConfig
from nexrl.inference.client import LLMServiceClient
from nexrl.inference.protocol import GenerationRequest, SamplingParams
from nexrl.monitoring import ActivityTracker, ActivityTrackerProxy
from nexrl.pools import TrainBatchPool
from tests.rollout_parts import build_rollout_side

# episode k: its reward and how many trajectories (unmerged turns) it makes
EPISODES = [(1.0, 2), (0.0, 1), (0.0, 1), (0.0, 2)]


class UnmergedTurns(RolloutWorkflow):
    """Episode k answers twice when EPISODES[k] says so, as two separate trajectories."""

    def __init__(self) -> None:
        self.count = itertools.count()

    async def arun_episode(self, engine, data):
        k = next(self.count)
        reward, turns = EPISODES[k]
        prompt = list(engine.tokenizer(data["prompt"])["input_ids"])
        out = []
        for turn in range(turns):
            gen = await engine.agenerate(GenerationRequest(prompt, SamplingParams(2)))
            sample = gen.outputs[0]
            out.append(
                {
                    "prompt_ids": prompt,
                    "response_ids": list(sample.output_ids),
                    "response_logprobs": list(sample.output_logprobs),
                    "token_versions": list(sample.output_versions),
                    "finish_reason": "stop",
                    "reward": reward,
                    "episode": k,
                    "turn": turn,
                }
            )
        return out


@pytest.fixture
def client(tiny_model_path):
    return LLMServiceClient({"backend": "builtin", "model": tiny_model_path, "model_tag": "t"})


def advantages(client, estimator: str) -> dict[int, float]:
    """Episode -> the advantage on its trajectories' tokens (the same on each of them)."""

    class Worker(AgentRolloutWorker):
        def __init__(self, config, llm_client, context, reward_fn=None):
            super().__init__(config, llm_client, context, reward_fn, workflow=UnmergedTurns())

    cfg = RolloutWorkerConfig(group_size=4, max_tokens=2, max_task_retries=0)
    items = [{"prompt": "abcd>", "uid": "u0"}]
    side = build_rollout_side(client, items, None, worker=cfg, worker_cls=Worker)
    try:
        assert side.worker._loop_once()
        batch = side.pool.get_batch()
    finally:
        side.worker.stop()
    assert batch is not None and len(batch) == 6  # 4 episodes, 6 trajectories, one group
    out = TrainBatchPool()
    proc = GRPOProcessor(
        AlgorithmConfig(advantage_estimator=estimator),
        ProcessorContext(batch_size=0, max_tokens=2, pad_token_id=0, warn_truncated=False),
    )
    proc.set_activity_tracker(ActivityTrackerProxy(ActivityTracker({})))
    proc.set_module_references(None, out)
    proc._fit(batch, "train")
    train = out.get_batch(batch.metadata.get("model_tag", "t"))
    adv, mask = train.values["advantages"], train.values["loss_mask"]
    per_episode: dict[int, float] = {}
    for k, row, m in zip(batch.values["episode"], adv, mask, strict=True):
        value = float(row[m > 0][0])
        assert torch.allclose(row[m > 0], torch.tensor(value))
        assert per_episode.setdefault(k, value) == pytest.approx(value)  # same in the episode
    return per_episode


def test_grpo_counts_a_two_trajectory_episode_once(client):
    # episode rewards [1, 0, 0, 0]: mean 0.25, unbiased std 0.5 (the 6 trajectories'
    # rewards [1, 1, 0, 0, 0, 0] would give mean 1/3 and +1.29 / -0.65)
    got = advantages(client, "grpo")
    assert got == pytest.approx({0: 1.5, 1: -0.5, 2: -0.5, 3: -0.5}, abs=1e-5)


def test_rloo_leaves_out_the_episode_not_its_trajectory(client):
    got = advantages(client, "rloo")
    assert got == pytest.approx({0: 1.0, 1: -1 / 3, 2: -1 / 3, 3: -1 / 3}, abs=1e-5)
    assert math.isclose(sum(got.values()), 0.0, abs_tol=1e-5)  # over episodes, not rows
