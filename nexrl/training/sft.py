"""Supervised fine-tuning on the torch engine: cross-entropy on prompt/response pairs.

`nexrl sft` with no arguments trains the embedded tiny model on the default
"shift letters" task (prompt "abcd>", answer "bcde" + EOS) generated here, and
saves an HF checkpoint that `actor.model_path` can point at as an RL warm start.

The SFT loss is one more per-token loss passed to the same `train_batch`: the
engine resolves `loss_fn` through the algorithm registry, which also accepts an
import path, so `"nexrl.training.sft:nll_loss"` works without registering it.
Prompt tokens are masked out with `loss_mask`; aggregation is the usual
token-mean over the whole step.
"""

from __future__ import annotations

import argparse
import json
import random
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from nexrl.training.config import EngineConfig
from nexrl.training.torch_engine import TorchTrainEngine
from nexrl.types import Batch

NLL_LOSS = "nexrl.training.sft:nll_loss"


def nll_loss(
    logprobs: torch.Tensor,  # (B, T)
    batch: dict[str, torch.Tensor],
    **_: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token negative log-likelihood (B, T); masking and aggregation happen in compute_loss."""
    mask = batch["loss_mask"]
    n = mask.sum().clamp(min=1)
    return -logprobs, {"nll_per_token": (-logprobs.detach() * mask).sum() / n}


def shift_letters(
    n: int, seed: int = 0, min_len: int = 3, max_len: int = 6
) -> list[tuple[str, str]]:
    """`n` pairs ("abcd>", "bcde"): each lowercase letter shifted by one, z wraps to a."""
    rng = random.Random(seed)
    letters = string.ascii_lowercase
    pairs = []
    for _ in range(n):
        word = "".join(rng.choice(letters) for _ in range(rng.randint(min_len, max_len)))
        pairs.append((word + ">", "".join(letters[(letters.index(c) + 1) % 26] for c in word)))
    return pairs


def build_batch(tokenizer: Any, pairs: Sequence[tuple[str, str]]) -> Batch:
    """Right-padded token batch; loss_mask covers the response and its EOS."""
    rows = []
    for prompt, response in pairs:
        p = tokenizer(prompt)["input_ids"]  # the tokenizer's BOS, exactly as RL rollouts see it
        r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((p, r))
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), width)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attention[i, : len(p) + len(r)] = 1
        loss_mask[i, len(p) : len(p) + len(r)] = 1
    return Batch({"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask})


@torch.no_grad()
def exact_match(engine: TorchTrainEngine, batch: Batch) -> float:
    """Fraction of rows whose every response token is the argmax (= greedy decoding)."""
    model = engine.model
    ids = batch.values["input_ids"].to(engine.device)
    att = batch.values["attention_mask"].to(engine.device)
    pred = model(input_ids=ids, attention_mask=att).logits.argmax(-1)[:, :-1].cpu()
    mask = batch.values["loss_mask"][:, 1:].bool()
    correct = (pred == batch.values["input_ids"][:, 1:]) | ~mask
    return float(correct.all(-1).float().mean())


def dataset_pairs(path: str, prompt_key: str, response_key: str) -> list[tuple[str, str]]:
    """(prompt, response) pairs from a jsonl / json / parquet file or a saved dataset."""
    from nexrl.data.hf import load_hf_dataset

    rows = load_hf_dataset(path)
    missing = {prompt_key, response_key} - set(rows.column_names)
    if missing:
        raise ValueError(f"{path}: no column(s) {sorted(missing)}; columns: {rows.column_names}")
    return [(str(r[prompt_key]), str(r[response_key])) for r in rows]


def run_sft(
    model_path: str,
    output: str,
    steps: int = 300,
    batch_size: int = 32,
    engine_config: EngineConfig | dict[str, Any] | None = None,
    seed: int = 0,
    eval_size: int = 128,
    pairs: Sequence[tuple[str, str]] | None = None,
) -> dict[str, float]:
    """Train `steps` steps, save to `output`, return metrics.

    `pairs` (prompt, response) are sampled with replacement; without them each
    step draws fresh shift-letters pairs.
    """
    from transformers import AutoTokenizer

    engine = TorchTrainEngine(EngineConfig.from_mapping(engine_config or {}), model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rng = random.Random(seed)
    held_out = list(pairs[:eval_size]) if pairs else shift_letters(eval_size, seed=10_000 + seed)
    eval_batch = build_batch(tokenizer, held_out)
    before = exact_match(engine, eval_batch)
    metrics: dict[str, float] = {}
    for step in range(steps):
        if pairs:
            chosen = [pairs[rng.randrange(len(pairs))] for _ in range(batch_size)]
        else:
            chosen = shift_letters(batch_size, seed=seed * 1_000_003 + step)
        metrics = engine.train_batch(build_batch(tokenizer, chosen), NLL_LOSS, {})
    engine.save(output)
    return {
        "loss": metrics.get("loss", float("nan")),
        "exact_match_before": before,
        "exact_match": exact_match(engine, eval_batch),
        "steps": float(engine.step),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """`nexrl sft [--model-path P] [--output DIR] [--steps N] [engine key=value ...]`."""
    from omegaconf import OmegaConf

    from nexrl.models.tiny import default_model_path

    p = argparse.ArgumentParser(prog="nexrl sft", description="SFT on shift-letters pairs")
    p.add_argument("--model-path", default=None, help="HF model dir (default: embedded tiny)")
    p.add_argument("--output", default="outputs/sft-shift-letters", help="checkpoint dir")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--data",
        default=None,
        help="jsonl/json/parquet or saved dataset (default: generated shift-letters pairs)",
    )
    p.add_argument("--prompt-key", default="prompt")
    p.add_argument("--response-key", default="answer")
    p.add_argument("overrides", nargs="*", help="engine config overrides, e.g. lr=1e-3")
    args = p.parse_args(argv)
    overrides = OmegaConf.to_container(OmegaConf.from_dotlist(list(args.overrides)))
    engine_config = {"lr": 1e-3, **overrides}  # type: ignore[dict-item]
    result = run_sft(
        str(args.model_path or default_model_path()),
        args.output,
        args.steps,
        args.batch_size,
        engine_config,
        args.seed,
        pairs=dataset_pairs(args.data, args.prompt_key, args.response_key) if args.data else None,
    )
    print(json.dumps({**result, "output": str(Path(args.output).resolve())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
