"""SFT: data layout, the NLL loss against a hand computation, and a short run."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nexrl.algorithms.objective import compute_loss
from nexrl.models.tiny import VOCAB_SIZE
from nexrl.training.sft import NLL_LOSS, build_batch, main, run_sft, shift_letters


def test_shift_letters_pairs():
    pairs = shift_letters(50, seed=3)
    assert all(p.endswith(">") and 3 <= len(r) <= 6 for p, r in pairs)
    for prompt, response in pairs:
        assert [(ord(b) - ord(a)) % 26 for a, b in zip(prompt[:-1], response, strict=True)] == [
            1
        ] * len(response)
    assert shift_letters(5, seed=3) == pairs[:5]


def test_build_batch_masks_the_prompt(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    batch = build_batch(tok, [("az>", "ba"), ("abcd>", "bcde")])
    ids = batch.values["input_ids"]
    # BOS + prompt, then the response and EOS (the only tokens in the loss)
    assert tok.decode(ids[0, :6]) == "<s>az>ba" and int(ids[0, 6]) == tok.eos_token_id
    assert batch.values["loss_mask"][0].tolist() == [0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0]
    assert batch.values["attention_mask"][0].tolist() == [1] * 7 + [0] * 4
    assert batch.values["loss_mask"][1].tolist() == [0] * 6 + [1] * 5


def test_nll_loss_through_compute_loss_is_cross_entropy_on_the_response(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    batch = build_batch(tok, shift_letters(4, seed=1))
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids, att = batch.values["input_ids"], batch.values["attention_mask"]
    logits = model(input_ids=ids, attention_mask=att).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    lp = torch.nn.functional.pad(lp, (1, 0))
    loss, _ = compute_loss(lp, batch.values, loss_fn=NLL_LOSS)
    labels = ids.masked_fill(batch.values["loss_mask"] == 0, -100)
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:])
    torch.testing.assert_close(loss, expected)


def test_short_sft_run_learns_and_saves_a_loadable_checkpoint(tiny_model, tmp_path):
    first = run_sft(
        tiny_model,
        str(tmp_path / "a"),
        steps=1,
        batch_size=16,
        engine_config={"lr": 3e-3},
        eval_size=8,
    )
    result = run_sft(
        tiny_model,
        str(tmp_path / "b"),
        steps=25,
        batch_size=16,
        engine_config={"lr": 3e-3},
        eval_size=8,
    )
    assert result["loss"] < 0.7 * first["loss"]
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "b").config.vocab_size == VOCAB_SIZE


def test_main_runs_with_overrides(tiny_model, tmp_path, capsys):
    out = tmp_path / "sft"
    rc = main(
        [
            "--model-path",
            tiny_model,
            "--output",
            str(out),
            "--steps",
            "2",
            "lr=1e-3",
            "micro_batch_tokens=64",
        ]
    )
    assert rc == 0 and (out / "trainer_state.pt").exists()
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 2.0
    with pytest.raises(ValueError, match="bogus"):
        main(["--model-path", tiny_model, "--output", str(out), "--steps", "1", "bogus=1"])


def test_sft_on_a_jsonl_dataset_then_rl_warm_start_loads(tmp_path, tiny_model):
    from nexrl.training.sft import main

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"q": f"{w}>", "a": w}) + "\n" for w in ["ab", "cd", "ef"]))
    out = tmp_path / "warm"
    assert (
        main(
            [
                "--model-path",
                tiny_model,
                "--output",
                str(out),
                "--steps",
                "2",
                "--batch-size",
                "3",
                "--data",
                str(data),
                "--prompt-key",
                "q",
                "--response-key",
                "a",
            ]
        )
        == 0
    )
    from nexrl.config import load_config

    cfg = load_config([f"model_path={out}"])  # the RL run's warm start
    assert AutoTokenizer.from_pretrained(cfg.model_path).bos_token_id is not None
    with pytest.raises(ValueError, match="no column"):
        main(
            ["--model-path", tiny_model, "--output", str(out), "--steps", "1", "--data", str(data)]
        )
