"""Invariances of the torch train engine on the tiny model (CPU, float32)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from nexrl.training.config import EngineConfig
from nexrl.training.microbatch import split_by_tokens
from nexrl.training.synthetic import random_batch
from nexrl.training.torch_engine import GPU_AUTOCAST_FLOPS, TorchTrainEngine, autocast_for

PPO = {"clip_low": 0.2, "clip_high": 0.28}


def params(engine: TorchTrainEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.named_parameters()}


def assert_same_update(a: TorchTrainEngine, b: TorchTrainEngine) -> None:
    """Same gradients (tight) and same weights after the step.

    Weights get a looser bound: Adam divides by sqrt(v), so for a gradient entry near 0
    fp32 summation-order noise becomes a visible fraction of one lr-sized update.
    """
    grads_b = {k: p.grad for k, p in b.model.named_parameters()}
    for name, p in a.model.named_parameters():
        torch.testing.assert_close(p.grad, grads_b[name], atol=1e-7, rtol=1e-4)
    for name, p in params(b).items():
        torch.testing.assert_close(params(a)[name], p, atol=1e-2 * a.config.lr, rtol=1e-5)


def hf_logprobs(model_path: str, batch) -> torch.Tensor:
    """Reference: one padded HF forward, log_softmax, gather (right padding)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ids, att = batch.values["input_ids"], batch.values["attention_mask"]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=att).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0)) * att


def test_split_by_tokens_respects_budget_and_order():
    att = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    assert split_by_tokens(att, 5) == [[0, 1], [2, 3]]
    assert split_by_tokens(att, 1) == [[0], [1], [2], [3]]  # an oversize row still runs
    assert split_by_tokens(att, 100) == [[0, 1, 2, 3]]


@pytest.mark.parametrize("packing", [True, False])
def test_logprobs_match_plain_hf_forward(tiny_model, packing):
    batch = random_batch(6, 10, seed=1)
    engine = TorchTrainEngine({"use_packing": packing, "micro_batch_tokens": 20}, tiny_model)
    ours = engine.compute_logprobs(batch)
    torch.testing.assert_close(ours, hf_logprobs(tiny_model, batch), atol=1e-5, rtol=1e-5)
    assert (ours[:, 0] == 0).all()


def test_left_padding_gives_the_same_logprobs_as_right_padding(tiny_model):
    right, left = random_batch(4, 10, seed=2), random_batch(4, 10, seed=2, right_pad=False)
    engine = TorchTrainEngine({}, tiny_model)
    lp_r, lp_l = engine.compute_logprobs(right), engine.compute_logprobs(left)
    att_r, att_l = right.values["attention_mask"].bool(), left.values["attention_mask"].bool()
    torch.testing.assert_close(lp_r[att_r], lp_l[att_l], atol=1e-5, rtol=1e-5)


def test_entropy_matches_hand_computation(tiny_model):
    batch = random_batch(3, 8, seed=3)
    engine = TorchTrainEngine({}, tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids, att = batch.values["input_ids"], batch.values["attention_mask"]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=att).logits[:, :-1], -1)
    expected = torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0)) * att
    torch.testing.assert_close(engine.compute_entropy(batch), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("packing", [True, False])
def test_micro_batches_of_one_equal_one_batch_of_eight(tiny_model, packing):
    batch = random_batch(8, 12, seed=4)
    whole = TorchTrainEngine({"micro_batch_tokens": 10_000, "use_packing": packing}, tiny_model)
    ones = TorchTrainEngine({"micro_batch_tokens": 1, "use_packing": packing}, tiny_model)
    m_whole = whole.train_batch(batch, "ppo_clip", PPO)
    m_ones = ones.train_batch(batch, "ppo_clip", PPO)
    assert m_ones["loss"] == pytest.approx(m_whole["loss"], rel=1e-5)
    assert m_ones["grad_norm"] == pytest.approx(m_whole["grad_norm"], rel=1e-4)
    assert_same_update(ones, whole)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_packed_equals_padded(tiny_model, agg):
    batch = random_batch(8, 12, seed=5)
    kwargs = {**PPO, "agg_mode": agg}
    packed = TorchTrainEngine({"use_packing": True, "micro_batch_tokens": 30}, tiny_model)
    padded = TorchTrainEngine({"use_packing": False, "micro_batch_tokens": 30}, tiny_model)
    m_p, m_d = (
        packed.train_batch(batch, "ppo_clip", kwargs),
        padded.train_batch(batch, "ppo_clip", kwargs),
    )
    assert m_p["loss"] == pytest.approx(m_d["loss"], rel=1e-5)
    assert_same_update(packed, padded)


def test_all_masked_batch_gives_zero_loss_zero_grad_no_nan(tiny_model):
    batch = random_batch(4, 10, seed=6)
    batch.values["loss_mask"].zero_()
    batch.values["advantages"].zero_()
    engine = TorchTrainEngine({"entropy": True}, tiny_model)
    before = params(engine)
    metrics = engine.train_batch(batch, "ppo_clip", PPO)
    assert metrics["loss"] == 0.0 and metrics["grad_norm"] == 0.0
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    for name, p in engine.model.named_parameters():
        assert p.grad is None or (p.grad == 0).all(), name
        assert torch.equal(p.detach(), before[name]), name


def test_training_lowers_the_loss_on_a_fixed_batch(tiny_model):
    batch = random_batch(8, 12, seed=7)
    batch.values["advantages"] = batch.values["loss_mask"].clone()  # push every token up
    engine = TorchTrainEngine({"lr": 1e-3}, tiny_model)
    before = (engine.compute_logprobs(batch) * batch.values["loss_mask"]).sum()
    for _ in range(5):
        batch.values["old_logprobs"] = engine.compute_logprobs(batch)
        engine.train_batch(batch, "ppo_clip", PPO)
    after = (engine.compute_logprobs(batch) * batch.values["loss_mask"]).sum()
    assert after > before and engine.step == 5


def test_cosine_schedule_with_warmup_reports_the_lr_of_each_step(tiny_model):
    cfg = {
        "lr": 1e-3,
        "lr_schedule": "cosine",
        "warmup_steps": 2,
        "total_steps": 4,
        "min_lr_ratio": 0.1,
    }
    engine = TorchTrainEngine(cfg, tiny_model)
    batch = random_batch(2, 8)
    lrs = [engine.train_batch(batch, "ppo_clip", PPO)["lr"] for _ in range(4)]
    # warmup 0, 0.5; then cosine from 1.0 to 0.1 over 2 steps: 1.0, 0.1 + 0.9 * 0.5
    assert lrs == pytest.approx([0.0, 5e-4, 1e-3, 5.5e-4])


def test_reference_model_is_frozen(tiny_model):
    batch = random_batch(4, 10, seed=8)
    engine = TorchTrainEngine({"ref_model_path": tiny_model, "lr": 1e-2}, tiny_model)
    ref0 = engine.compute_ref_logprobs(batch)
    torch.testing.assert_close(ref0, engine.compute_logprobs(batch))
    engine.train_batch(batch, "ppo_clip", PPO)
    assert torch.equal(engine.compute_ref_logprobs(batch), ref0)
    assert not torch.allclose(engine.compute_logprobs(batch), ref0)
    assert TorchTrainEngine({}, tiny_model).compute_ref_logprobs(batch) is None


def test_missing_field_and_unknown_config_key_fail_clearly(tiny_model):
    engine = TorchTrainEngine({}, tiny_model)
    batch = random_batch(2, 6)
    del batch.values["loss_mask"]
    with pytest.raises(KeyError, match="loss_mask"):
        engine.train_batch(batch, "ppo_clip", {})
    with pytest.raises(ValueError, match="micro_batch_tokns"):
        EngineConfig.from_mapping({"micro_batch_tokns": 3})
    with pytest.raises(ValueError, match="lr_schedule"):
        EngineConfig(lr_schedule="linear")


def test_gradient_checkpointing_gives_the_same_step(tiny_model):
    batch = random_batch(6, 12, seed=12)
    plain = TorchTrainEngine({}, tiny_model)
    ckpt = TorchTrainEngine({"gradient_checkpointing": True}, tiny_model)
    m_plain, m_ckpt = (
        plain.train_batch(batch, "ppo_clip", PPO),
        ckpt.train_batch(batch, "ppo_clip", PPO),
    )
    assert m_ckpt["loss"] == pytest.approx(m_plain["loss"], rel=1e-6)
    assert_same_update(ckpt, plain)


def test_entropy_metric_is_the_token_mean_entropy(tiny_model):
    batch = random_batch(6, 12, seed=13)
    engine = TorchTrainEngine({"entropy": True}, tiny_model)
    mask = batch.values["loss_mask"]
    expected = float((engine.compute_entropy(batch) * mask).sum() / mask.sum())
    metrics = engine.train_batch(batch, "ppo_clip", {**PPO, "entropy_coef": 0.01})
    assert metrics["entropy"] == pytest.approx(expected, rel=1e-5)
    assert metrics["loss"] == pytest.approx(metrics["policy_loss"] - 0.01 * expected, rel=1e-5)


def test_bfloat16_autocast_runs_and_stays_close(tiny_model):
    batch = random_batch(4, 10, seed=14)
    fp32 = TorchTrainEngine({}, tiny_model).compute_logprobs(batch)
    engine = TorchTrainEngine({"dtype": "bfloat16"}, tiny_model)
    lp = engine.compute_logprobs(batch)
    assert lp.dtype == torch.float32 and (lp - fp32).abs().max() < 0.1
    assert torch.isfinite(torch.tensor(engine.train_batch(batch, "ppo_clip", PPO)["loss"]))


def test_auto_dtype_autocasts_on_a_gpu_only_where_the_arithmetic_pays():
    """`dtype: auto` is bfloat16 autocast on a GPU from GPU_AUTOCAST_FLOPS of forward +
    backward arithmetic on, float32 below it (a small model's casts cost more than they
    save) and on a CPU; an explicit dtype holds at any size. The rule reads the device's
    type only, so it is checked on a CPU."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert autocast_for("auto", cuda, GPU_AUTOCAST_FLOPS) is torch.bfloat16
    assert autocast_for("auto", cuda, GPU_AUTOCAST_FLOPS - 1) is None
    assert autocast_for("auto", cpu, 1e18) is None
    assert autocast_for("bfloat16", cuda, 1.0) is torch.bfloat16
    assert autocast_for("float16", cpu, 1.0) is torch.float16
    assert autocast_for("float32", cuda, 1e18) is None


def test_auto_dtype_decides_by_the_micro_batch_tokens(tiny_model, monkeypatch):
    """The forward runs under the dtype chosen for its micro-batch's real tokens."""
    engine = TorchTrainEngine({}, tiny_model)
    batch = random_batch(4, 10, seed=15)
    seen: list[int] = []
    monkeypatch.setattr(engine, "autocast_dtype", lambda tokens: seen.append(tokens))
    engine.compute_logprobs(batch)
    assert seen == [int(batch.values["attention_mask"].sum())]
    engine.device = torch.device("cuda")  # the rule only: nothing runs on it
    monkeypatch.undo()
    tokens = 100
    engine._n_params = math.ceil(GPU_AUTOCAST_FLOPS / (6 * tokens))
    assert engine.autocast_dtype(tokens) is torch.bfloat16
    assert engine.autocast_dtype(tokens - 1) is None
