"""Memory options of the torch train engine: chunked logprobs, checkpointing, LoRA."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from nexrl.training.config import EngineConfig
from nexrl.training.microbatch import chunked_token_logprobs, make_inputs, token_logprobs
from nexrl.training.synthetic import random_batch
from nexrl.training.torch_engine import TorchTrainEngine

PPO = {"clip_low": 0.2, "clip_high": 0.28}
LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}


def grads(engine: TorchTrainEngine) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in engine.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunked_logprobs_equal_full_logits(tiny_model, packed, chunk):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    batch = random_batch(5, 11, seed=3, right_pad=not packed)
    ids, att = batch.values["input_ids"], batch.values["attention_mask"]
    inputs = make_inputs(ids, att, packed)
    kwargs = {"input_ids": inputs.input_ids, "position_ids": inputs.position_ids}
    with torch.no_grad():
        out = model(**kwargs, attention_mask=inputs.attention_mask, output_hidden_states=True)
        full_lp, full_ent = token_logprobs(out.logits, inputs, with_entropy=True)
        hidden = out.hidden_states[-1]
        lp, ent = chunked_token_logprobs(
            hidden, model.lm_head.weight, inputs, None, True, chunk_tokens=chunk
        )
    torch.testing.assert_close(lp, full_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, full_ent, atol=1e-5, rtol=0)


def test_engine_chunked_equals_unchunked_logprobs_and_gradients(tiny_model):
    batch = random_batch(6, 12, seed=21)
    full = TorchTrainEngine({"logprob_chunk_tokens": 0}, tiny_model)
    chunked = TorchTrainEngine({"logprob_chunk_tokens": 5}, tiny_model)
    torch.testing.assert_close(
        chunked.compute_logprobs(batch), full.compute_logprobs(batch), atol=1e-5, rtol=0
    )
    batch.values["old_logprobs"] = full.compute_logprobs(batch)
    m_full = full.train_batch(batch, "ppo_clip", {**PPO, "entropy_coef": 0.01})
    m_chunk = chunked.train_batch(batch, "ppo_clip", {**PPO, "entropy_coef": 0.01})
    assert m_chunk["loss"] == pytest.approx(m_full["loss"], rel=1e-5)
    g_full = grads(full)
    for name, g in grads(chunked).items():
        torch.testing.assert_close(g, g_full[name], atol=1e-6, rtol=1e-4)


def test_response_positions_only(tiny_model):
    batch = random_batch(4, 10, seed=22)
    mask = batch.values["loss_mask"].bool()
    every = TorchTrainEngine({}, tiny_model).compute_logprobs(batch)
    resp = TorchTrainEngine({"logprob_positions": "response"}, tiny_model)
    lp = resp.compute_logprobs(batch)
    torch.testing.assert_close(lp[mask], every[mask], atol=1e-5, rtol=0)
    assert (lp[~mask] == 0).all() and (every[~mask & (every != 0)]).numel() > 0
    del batch.values["loss_mask"]
    with pytest.raises(KeyError, match="loss_mask"):
        resp.compute_logprobs(batch)


def test_chunked_with_gradient_checkpointing_gives_the_same_gradients(tiny_model):
    batch = random_batch(6, 12, seed=23)
    plain = TorchTrainEngine({"logprob_chunk_tokens": 0}, tiny_model)
    ckpt = TorchTrainEngine({"gradient_checkpointing": True, "logprob_chunk_tokens": 8}, tiny_model)
    plain.train_batch(batch, "ppo_clip", PPO)
    ckpt.train_batch(batch, "ppo_clip", PPO)
    g_plain = grads(plain)
    for name, g in grads(ckpt).items():
        torch.testing.assert_close(g, g_plain[name], atol=1e-6, rtol=1e-4)


def test_lora_trains_only_adapters_and_exports_merged_weights(tiny_model, tmp_path):
    engine = TorchTrainEngine({"lora": LORA, "lr": 1e-2}, tiny_model)
    trainable = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    base_before = engine.export_weights()
    engine.train_batch(random_batch(4, 10, seed=24), "ppo_clip", PPO)
    exported = engine.export_weights()
    reference = copy.deepcopy(engine.model).merge_and_unload().state_dict()
    assert set(exported) == set(reference) == set(base_before)
    for name, value in reference.items():
        torch.testing.assert_close(exported[name], value, atol=1e-6, rtol=0)
    changed = [n for n in exported if not torch.equal(exported[n], base_before[n])]
    assert changed and all(n.split(".")[-2] in LORA["target_modules"] for n in changed)
    # the HF directory form holds the merged weights under the base names
    out = tmp_path / "export"
    assert engine.export_weights(str(out)) == str(out)
    on_disk = load_file(str(out / "model.safetensors"))
    assert on_disk and (out / "config.json").exists()
    for name, value in on_disk.items():  # base names (a tied lm_head may be left out)
        torch.testing.assert_close(value, exported[name])


def test_lora_checkpoint_resumes_exactly(tiny_model, tmp_path):
    batch = random_batch(4, 10, seed=25)
    a = TorchTrainEngine({"lora": LORA, "lr": 1e-2}, tiny_model)
    a.train_batch(batch, "ppo_clip", PPO)
    a.save(str(tmp_path / "ckpt"))
    b = TorchTrainEngine({"lora": LORA, "lr": 1e-2}, tiny_model)
    b.load(str(tmp_path / "ckpt"))
    assert b.step == 1
    a.train_batch(batch, "ppo_clip", PPO)
    b.train_batch(batch, "ppo_clip", PPO)
    ea, eb = a.export_weights(), b.export_weights()
    for name, value in ea.items():
        torch.testing.assert_close(eb[name], value, atol=1e-7, rtol=0)
    plain = TorchTrainEngine({}, tiny_model)
    with pytest.raises(KeyError):
        plain.load(str(tmp_path / "ckpt"))  # an adapter is not a full checkpoint


def test_bad_memory_options_fail_naming_the_key():
    with pytest.raises(ValueError, match="lora key"):
        EngineConfig(lora={"rnk": 4})
    with pytest.raises(ValueError, match="lora.rank"):
        EngineConfig(lora={"rank": 0})
    with pytest.raises(ValueError, match="logprob_positions"):
        EngineConfig(logprob_positions="prompt")
    with pytest.raises(ValueError, match="logprob_chunk_tokens"):
        EngineConfig(logprob_chunk_tokens=-1)
    assert EngineConfig(lora={}).lora == {
        "rank": 16,
        "alpha": 32,
        "target_modules": "all-linear",
        "dropout": 0.0,
    }


def test_export_without_copy_shares_the_trainers_tensors(tiny_model, tmp_path):
    """The in-process weight hand-off publishes the trainer's own tensors (one copy of the
    weights less); a plain export and a checkpoint stay independent of later updates."""
    engine = TorchTrainEngine({}, tiny_model)
    params = {k: p.data_ptr() for k, p in engine.model.named_parameters()}
    shared = engine.export_weights(None, copy=False)
    copied = engine.export_weights(None)
    assert all(shared[k].data_ptr() == ptr for k, ptr in params.items())
    assert all(copied[k].data_ptr() != ptr for k, ptr in params.items())
    engine.save(str(tmp_path / "ckpt"))
    engine.train_batch(random_batch(4, 10, seed=2), "ppo_clip", PPO)
    saved = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    for name, tensor in saved.items():
        assert torch.equal(tensor, copied[name]), name  # what was there at the save
        assert not torch.equal(tensor, shared[name]), name  # the shared ones moved on


def test_an_engine_built_on_a_given_model_trains_it(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    engine = TorchTrainEngine({}, "in-memory", model=model)
    before = copy.deepcopy(model.state_dict())
    engine.train_batch(random_batch(4, 10, seed=2), "ppo_clip", PPO)
    assert engine.model is model and engine.model_path == "in-memory"
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_release_host_memory_is_auto_by_size_and_never_on_a_gpu():
    from nexrl.host_memory import AUTO_MIN_PARAMS, release_wanted

    assert release_wanted(None, "cpu", AUTO_MIN_PARAMS) is True
    assert release_wanted(None, "cpu", AUTO_MIN_PARAMS - 1) is False
    assert release_wanted(True, "cpu", 10) is True and release_wanted(False, "cpu", 10**9) is False
    assert release_wanted(True, "cuda", 10**9) is False


@pytest.mark.parametrize("setting", [True, False])
def test_release_host_memory_switch_trains_and_releases(tiny_model, setting, monkeypatch):
    from nexrl.host_memory import release_freed_memory
    from nexrl.training import torch_engine

    assert release_freed_memory() is True  # glibc: malloc_trim exists and ran
    calls: list[bool] = []
    monkeypatch.setattr(torch_engine, "release_freed_memory", lambda: calls.append(True))
    engine = TorchTrainEngine({"lr": 1e-3, "release_host_memory": setting}, tiny_model)
    before = {k: p.detach().clone() for k, p in engine.model.named_parameters()}
    engine.train_batch(random_batch(4, 9, seed=1), "ppo_clip", PPO)
    moved = any(not torch.equal(before[k], p) for k, p in engine.model.named_parameters())
    assert moved and calls == ([True] if setting else [])


def test_released_gradients_live_in_one_block_and_give_the_same_update(tiny_model):
    """With `release_host_memory` a step's gradients are views of one block (one mapping
    the allocator returns whole), dropped after the update; the weights come out as
    without it, bit for bit, over two steps (the second one with AdamW state)."""
    engines = {
        s: TorchTrainEngine(
            {"lr": 1e-3, "release_host_memory": s, "micro_batch_tokens": 12}, tiny_model
        )
        for s in (True, False)
    }
    for seed in (1, 2):
        metrics = {
            s: e.train_batch(random_batch(4, 9, seed=seed), "ppo_clip", PPO)
            for s, e in engines.items()
        }
    # the memory went back after the update; the seconds that took
    assert metrics[True]["release_s"] > 0 and "release_s" not in metrics[False]
    on, off = (dict(engines[s].model.named_parameters()) for s in (True, False))
    assert all(torch.equal(on[k], off[k]) for k in on)
    assert all(p.grad is None for p in on.values())  # freed with the step
    assert all(p.grad is not None for p in off.values() if p.requires_grad)
    engines[True]._zero_grads()
    storages = {p.grad.untyped_storage().data_ptr() for p in on.values() if p.requires_grad}
    assert len(storages) == 1 and all(not p.grad.any() for p in on.values())
