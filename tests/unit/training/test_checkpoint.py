"""Checkpoints: HF-loadable weights, exact resume, weight export."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nexrl.training.synthetic import random_batch
from nexrl.training.torch_engine import TorchTrainEngine

CFG = {
    "deterministic": True,
    "lr_schedule": "cosine",
    "warmup_steps": 1,
    "total_steps": 6,
    "weight_decay": 0.01,
    "micro_batch_tokens": 40,
}
PPO = {"clip_low": 0.2, "clip_high": 0.28}


def run_steps(engine: TorchTrainEngine, seeds: range) -> list[float]:
    losses = []
    for s in seeds:
        batch = random_batch(6, 12, seed=s)
        batch.values["old_logprobs"] = engine.compute_logprobs(batch)
        losses.append(engine.train_batch(batch, "ppo_clip", PPO)["loss"])
    return losses


def test_resume_is_bitwise_exact(tiny_model, tmp_path):
    straight = TorchTrainEngine(CFG, tiny_model)
    losses_straight = run_steps(straight, range(4))

    first = TorchTrainEngine(CFG, tiny_model)
    losses = run_steps(first, range(2))
    first.save(str(tmp_path / "ck"))
    resumed = TorchTrainEngine(CFG, tiny_model)
    resumed.load(str(tmp_path / "ck"))
    assert resumed.step == 2
    losses += run_steps(resumed, range(2, 4))

    assert losses == losses_straight
    for (name, a), b in zip(
        straight.model.named_parameters(), resumed.model.parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    sa, sb = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"]) for k in sa)
    assert straight.scheduler.get_last_lr() == resumed.scheduler.get_last_lr()


def test_checkpoint_loads_with_from_pretrained(tiny_model, tmp_path):
    engine = TorchTrainEngine({"lr": 1e-2}, tiny_model)
    run_steps(engine, range(1))
    engine.save(str(tmp_path / "ck"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ck", dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tmp_path / "ck")
    assert tok.eos_token_id == 2
    for name, p in engine.model.named_parameters():
        torch.testing.assert_close(model.get_parameter(name), p.detach(), atol=0, rtol=0)


def test_export_weights_dict_and_directory(tiny_model, tmp_path):
    engine = TorchTrainEngine({"lr": 1e-2}, tiny_model)
    run_steps(engine, range(1))
    state = engine.export_weights()
    assert state["model.embed_tokens.weight"].device.type == "cpu"
    state["model.norm.weight"].add_(1.0)  # a copy: the engine is untouched
    assert not torch.equal(state["model.norm.weight"], engine.model.model.norm.weight)
    path = engine.export_weights(str(tmp_path / "w"))
    fresh = TorchTrainEngine({}, path)
    batch = random_batch(3, 8, seed=9)
    torch.testing.assert_close(
        fresh.compute_logprobs(batch), engine.compute_logprobs(batch), atol=0, rtol=0
    )
