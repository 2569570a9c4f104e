"""Seed 004's `TrainEngine` API, `Actor` / `Critic`, and the weight path to an
`InferenceEngine`, on the tiny model."""

from __future__ import annotations

import asyncio

import pytest
import torch

from nexrl.areal import (
    Actor,
    Critic,
    FinetuneSpec,
    InferenceEngine,
    SaveLoadMeta,
    TrainEngine,
    WeightUpdateMeta,
)
from nexrl.training.critic import gae


def batch(vocab: int, rows: int = 4, length: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    attention = torch.ones(rows, length, dtype=torch.long)
    attention[0, -3:] = 0  # one right-padded row
    loss = attention.float()
    loss[:, :4] = 0  # a 4-token prompt
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss}


def nll(logits: torch.Tensor, mb: dict) -> torch.Tensor:
    """A callable loss: token-mean negative log-likelihood on `loss_mask`."""
    lp = torch.log_softmax(logits[:, :-1].float(), -1)
    picked = lp.gather(-1, mb["input_ids"][:, 1:, None]).squeeze(-1)
    mask = mb["loss_mask"][:, 1:]
    return -(picked * mask).sum() / mask.sum()


@pytest.fixture
def engine(tiny_model_path):
    eng = TrainEngine(
        {
            "path": tiny_model_path,
            "engine": {"lr": 1e-2, "micro_batch_tokens": 24, "lr_schedule": "cosine"},
        }
    )
    eng.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=40, train_batch_size=4))
    yield eng
    eng.destroy()


@pytest.mark.slow
def test_a_callable_loss_trains_and_the_schedule_moves_only_when_stepped(engine):
    data = batch(engine.model.config.vocab_size)
    before = engine.eval_batch(data, nll, lambda mb: float(mb["loss_mask"].sum()))
    lrs = []
    for _ in range(5):
        stats = engine.train_batch(data, nll, lambda mb: float(mb["loss_mask"].sum()))
        lrs.append(stats["lr"])
    after = engine.eval_batch(data, nll, lambda mb: float(mb["loss_mask"].sum()))
    assert after < before - 0.5
    assert len(set(lrs)) == 1  # no scheduler step inside train_batch (PPO mini-batches)
    engine.step_lr_scheduler()
    assert engine.engine.optimizer.param_groups[0]["lr"] < lrs[0]  # cosine over 10 steps
    assert engine.engine.step == 5


def test_micro_batches_weighted_by_loss_weight_fn_give_the_whole_batch_loss(engine):
    data = batch(engine.model.config.vocab_size)  # 24 tokens a micro-batch: 2 rows each
    weight = lambda mb: float(mb["loss_mask"].sum())  # noqa: E731
    split = engine.eval_batch(data, nll, weight)
    engine.engine.config.micro_batch_tokens = 10_000
    whole = engine.eval_batch(data, nll, weight)
    assert torch.allclose(split, whole, atol=1e-5)


def test_forward_post_hook_and_aggregate(engine):
    data = batch(engine.model.config.vocab_size)
    rows = engine.forward(data, post_hook=lambda out, mb: out.shape[0], aggregate_fn=sum)
    assert rows == 4
    logits = engine.forward(data)
    assert logits.shape == (4, 12, engine.model.config.vocab_size)
    with pytest.raises(ValueError, match="output_seqlens"):
        engine.forward(data, output_seqlens=[[12]] * 4)


def test_scheduling_config_names_the_resources(engine):
    cfg = engine.get_scheduling_config()
    assert cfg["device"] in ("cpu", "cuda") and cfg["cpu"] >= 1 and cfg["mem_gib"] > 0


@pytest.mark.slow
def test_save_and_load_with_and_without_optimizer(engine, tmp_path):
    data = batch(engine.model.config.vocab_size)
    engine.train_batch(data, nll, None)
    engine.save(SaveLoadMeta(str(tmp_path / "full"), "hf", with_optim=True))
    engine.save(SaveLoadMeta(str(tmp_path / "weights"), "hf", with_optim=False))
    trained = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.train_batch(data, nll, None)
    engine.load(SaveLoadMeta(str(tmp_path / "full"), with_optim=True))
    assert engine.engine.step == 1
    assert all(torch.equal(v, engine.model.state_dict()[k]) for k, v in trained.items())
    engine.train_batch(data, nll, None)
    engine.load(SaveLoadMeta(str(tmp_path / "weights")))
    assert all(torch.equal(v, engine.model.state_dict()[k]) for k, v in trained.items())
    assert (tmp_path / "weights" / "config.json").exists()
    with pytest.raises(ValueError, match="weight_format='dcp'"):
        SaveLoadMeta(str(tmp_path), "dcp")


@pytest.mark.slow
def test_upload_then_update_moves_the_trained_weights_to_the_inference_engine(engine, tmp_path):
    rollout = InferenceEngine(engine=None, config={"path": engine.engine.model_path})
    rollout.initialize()
    try:
        assert rollout.check_health() and rollout.version == 0
        engine.train_batch(batch(engine.model.config.vocab_size), nll, None)
        meta = WeightUpdateMeta(
            type="disk", path=str(tmp_path / "sync"), alloc_mode=None, comm_backend=None
        )
        future = rollout.update_weights(meta)  # waits for the upload
        assert not future.done()
        engine.upload_weights(meta)
        future.result(timeout=60)
        assert rollout.version == 1  # the train step
        served = rollout.engine.model.state_dict()
        for name, value in engine.model.state_dict().items():
            assert torch.allclose(served[name].float(), value.float()), name
        # a second update on the same directory waits for a *new* upload
        again = rollout.update_weights(meta)
        assert not again.done()
        engine.train_batch(batch(engine.model.config.vocab_size, seed=1), nll, None)
        asyncio.run(_await(engine.upload_weights(meta)))  # the seed's `async` form
        asyncio.run(_await(again))
        assert rollout.version == 2
    finally:
        rollout.destroy()
    with pytest.raises(ValueError, match="nccl needs a GPU"):
        WeightUpdateMeta(type="nccl")


async def _await(awaitable):
    return await awaitable


def test_gae_matches_a_hand_computation():
    values = torch.tensor([[0.0, 0.5, 0.2, 0.9]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    adv, ret = gae(torch.tensor([1.0]), values, mask, gamma=0.9, lam=0.8)
    d3 = 1.0 - 0.9
    d2 = 0.9 * 0.9 - 0.2
    d1 = 0.9 * 0.2 - 0.5
    a3, a2 = d3, d2 + 0.72 * d3
    a1 = d1 + 0.72 * a2
    assert torch.allclose(adv, torch.tensor([[0.0, a1, a2, a3]]))
    assert torch.allclose(ret, (adv + values) * mask)


@pytest.mark.slow
def test_ppo_with_a_critic_the_value_loss_falls(tiny_model_path):
    cfg = {
        "path": tiny_model_path,
        "engine": {"lr": 5e-3},
        "ppo_n_minibatches": 2,
        "gamma": 1.0,
        "lam": 0.95,
    }
    actor, critic = Actor(cfg), Critic(cfg)
    actor.initialize()
    critic.initialize()
    data = batch(actor.model.config.vocab_size)
    data["rewards"] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    data["logprobs"] = actor.compute_logps(data)
    losses = []
    for _ in range(6):
        data["values"] = critic.compute_values(data)
        assert data["values"].shape == (4, 12)
        data.update(actor.compute_advantages_and_returns(data))
        losses.append(critic.eval_batch(data, critic._loss).item())
        stats = critic.ppo_update(data)
        assert len(stats) == 2  # one optimizer step per mini-batch
        actor.ppo_update(data)
    assert losses[-1] < 0.5 * losses[0]
    assert actor.engine.step == 12 and critic.engine.step == 12


def test_a_registered_loss_name_takes_the_engines_own_step(engine):
    data = batch(engine.model.config.vocab_size)
    data["advantages"] = data["loss_mask"].clone()
    stats = engine.train_batch(data, "ppo_clip", {"clip_low": 0.2, "clip_high": 0.28})
    assert stats["step"] == 1.0 and engine.engine.step == 1 and stats["loss_tokens"] > 0
    with pytest.raises(TypeError, match="keyword arguments"):
        engine.train_batch(data, "ppo_clip", lambda mb: 1.0)
