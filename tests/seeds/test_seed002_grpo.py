"""Seed 002's single-controller GRPO loop: the seed's `grpo_train` snippet as written
(one change, marked `# CHANGED:`) and `nexrl.distributed.grpo_loop.grpo_train`, both on
nexrl's policy (in-process train engine), generation (built-in engine), loss and a
tiny local model, for a few steps."""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Iterable

import pytest
import torch

from nexrl.data.tasks import write_shift_task
from nexrl.distributed.grpo_loop import (
    BatchedDataDict,
    DatumSpec,
    EnvironmentInterface,
    Generation,
    GenerationInterface,
    GRPOLossFn,
    Policy,
    PolicyInterface,
    RewardEnvironment,
    batches,
    calculate_grpo_training_data,
    grpo_train,
)

num_generations_per_prompt = 4  # FILLED: a free variable of the seed's snippet
VOWELS = set("aeiou")


def vowel_share(prompt: str, completion: str, **row) -> float:
    """A reward that differs between samples of the tiny model (its letters are random)."""
    return sum(c in VOWELS for c in completion) / max(1, len(completion))


# ---- seed 002: "Single-Controller and Execution Diagram" ----
# data processing/transformations between each step omitted
def seed_grpo_train(
    policy: PolicyInterface,
    policy_generation: GenerationInterface,
    environment: EnvironmentInterface,
    dataloader: Iterable[BatchedDataDict[DatumSpec]],
):
    loss_fn = GRPOLossFn()  # noqa: F841  (the seed builds it, then passes the class)
    for batch in dataloader:
        batch.repeat_interleave(num_generations_per_prompt)  # repeat for GRPO
        generations = policy_generation.generate(batch)
        rewards = environment.step(generations)

        logprobs = policy.get_logprobs(generations)
        reference_logprobs = policy.get_reference_logprobs(generations)

        training_data = calculate_grpo_training_data(
            generations, logprobs, reference_logprobs, rewards
        )
        # CHANGED: the seed passes `generations` and never uses `training_data`
        policy.train(training_data, logprobs, reference_logprobs, GRPOLossFn)


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict]:
    train, _ = write_shift_task(tmp_path_factory.mktemp("task"), n_train=64, n_val=4)
    return [json.loads(line) for line in train.read_text().splitlines()]


@pytest.fixture(scope="module")
def actors(tiny_model_path):
    torch.set_num_threads(1)
    policy = Policy(tiny_model_path, {"lr": 1e-3})
    generation = Generation(tiny_model_path, max_new_tokens=6, max_batch_size=32)
    yield policy, generation
    generation.shutdown()
    policy.shutdown()


def test_the_names_are_seed_002s():
    params = list(inspect.signature(grpo_train).parameters)
    assert params[:4] == ["policy", "policy_generation", "environment", "dataloader"]
    assert params == list(inspect.signature(seed_grpo_train).parameters) + [
        "num_generations_per_prompt",
        "loss_fn",
        "max_steps",
    ]
    assert {"get_logprobs", "get_reference_logprobs", "train"} <= set(dir(PolicyInterface))
    assert "generate" in dir(GenerationInterface) and "step" in dir(EnvironmentInterface)
    batch = BatchedDataDict.from_rows([{"prompt": "ab>"}, {"prompt": "cd>"}])
    assert batch.repeat_interleave(2) is batch
    assert batch == {"prompt": ["ab>", "ab>", "cd>", "cd>"], "group": [0, 0, 1, 1]}


def test_the_seed_loop_as_written_trains_the_policy(actors, rows):
    policy, generation = actors
    before = policy.client.get_step()
    env = RewardEnvironment(f"{__name__}:vowel_share")
    seed_grpo_train(policy, generation, env, batches(rows[:4], 2))
    assert policy.client.get_step() == before + 2


def test_a_step_raises_the_logprob_of_samples_with_positive_advantage(actors, rows):
    policy, generation = actors
    batch = BatchedDataDict.from_rows(rows[8:12]).repeat_interleave(4)
    generations = generation.generate(batch)
    rewards = RewardEnvironment(f"{__name__}:vowel_share").step(generations)
    assert len(set(rewards)) > 1
    logprobs = policy.get_logprobs(generations)
    data = calculate_grpo_training_data(generations, logprobs, None, rewards)
    metrics = policy.train(data, logprobs, None, GRPOLossFn(clip_low=10.0, clip_high=10.0))
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    after = policy.get_logprobs(generations)
    adv, mask = data["advantages"], data["loss_mask"]
    assert float((adv * (after - logprobs) * mask).sum()) > 0  # the policy-gradient direction
    with pytest.raises(ValueError, match="needs `advantages`"):
        policy.train(generations, logprobs, None, GRPOLossFn)
    with pytest.raises(ValueError, match="15 rewards for 16 generations"):
        calculate_grpo_training_data(generations, logprobs, None, rewards[:15])
    with pytest.raises(ValueError, match=r"reward on generation 0 \(prompt '.*>'\): TypeError"):
        RewardEnvironment(lambda prompt, completion: 1.0).step(generations)  # no **row


def test_grpo_train_three_steps_moves_loss_kl_and_reward_and_syncs_weights(actors, rows):
    policy, generation = actors
    env = RewardEnvironment(f"{__name__}:vowel_share")
    history = grpo_train(
        policy,
        generation,
        env,
        batches(rows[16:], 4),
        num_generations_per_prompt=4,
        loss_fn=GRPOLossFn(kl_coef=0.01),
        max_steps=3,
    )
    assert [h["step"] for h in history] == [1, 2, 3]
    assert all(math.isfinite(h["loss"]) and 0.0 <= h["reward"] <= 1.0 for h in history)
    assert len({h["reward"] for h in history}) > 1 and len({h["loss"] for h in history}) > 1
    assert history[-1]["kl"] > 0  # the policy left its reference
    versions = [h["version"] for h in history]
    assert versions == sorted(set(versions)) and versions[-1] == generation.engine.version
    served = generation.engine.model.state_dict()
    trained = policy.export_weights()
    assert all(torch.equal(served[k].float(), v.float()) for k, v in trained.items())


@pytest.mark.ray
@pytest.mark.slow
def test_the_policy_on_a_ray_worker_group_of_two_ranks(ray_local, tiny_model_path, rows):
    """Seed 002's layering: the policy's ranks are a RayWorkerGroup on a RayVirtualCluster
    (`RayDataParallelTrainClient`); the loop does not change."""
    from nexrl.distributed.dp_train import RayDataParallelTrainClient
    from nexrl.distributed.settings import RaySettings, actor_env

    engine = {"lr": 1e-3, "ref_model_path": tiny_model_path}
    client = RayDataParallelTrainClient(
        {},
        engine,
        tiny_model_path,
        bundles_per_node=[2],
        num_cpus_per_bundle=0.5,
        env_vars=actor_env(RaySettings()),
    )
    client.initialize()
    policy = Policy(tiny_model_path, client=client)
    generation = Generation(tiny_model_path, max_new_tokens=6, max_batch_size=16)
    try:
        env = RewardEnvironment(f"{__name__}:vowel_share")
        history = grpo_train(
            policy, generation, env, batches(rows[:4], 2), loss_fn=GRPOLossFn(kl_coef=0.01)
        )
        assert [h["step"] for h in history] == [1, 2] and client.get_step() == 2
        assert history[-1]["kl"] > 0 and generation.engine.version == 2
    finally:
        generation.shutdown()
        policy.shutdown()
