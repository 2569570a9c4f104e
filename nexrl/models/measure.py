"""Memory and speed of a real model in nexrl's engines (benchmarks/results/models.md).

    python -m nexrl.models.measure serve --model smollm2 --chats 64 --tokens 64
    python -m nexrl.models.measure train --model smollm2 --options '{"lora": {}}'

Each command runs in its own process and prints one JSON line. Peak resident memory
is the kernel's high-water mark (VmHWM), reset after the model is loaded, so it is
the peak of the measured work on top of the loaded model.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS (Linux)


def _mib(kib: int) -> float:
    return round(kib / 1024, 1)


def _model(name: str) -> str:
    from nexrl.models.sources import resolve_model, smollm2_dir

    return str(smollm2_dir() if name == "smollm2" else resolve_model(name))


def serve(model: str, chats: int, tokens: int, max_model_len: int | None) -> dict:
    """RSS and throughput of the built-in engine with `chats` concurrent chat requests."""
    from transformers import AutoTokenizer

    from nexrl.inference.engine import Engine
    from nexrl.inference.protocol import GenerationRequest, SamplingParams

    path = _model(model)
    tok = AutoTokenizer.from_pretrained(path)
    rss0 = _status_kib("VmRSS")
    engine = Engine(path, max_batch_size=max(chats, 1), max_model_len=max_model_len)
    loaded = _status_kib("VmRSS")
    _reset_peak()
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"What is {i} + {2 * i + 3}?"}],
            add_generation_prompt=True,
            return_dict=False,
        )
        for i in range(chats)
    ]
    params = SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=0, ignore_eos=True)
    start = time.perf_counter()
    with ThreadPoolExecutor(chats) as pool:
        outs = list(pool.map(lambda ids: engine.generate(GenerationRequest(ids, params)), prompts))
    seconds = time.perf_counter() - start
    engine.shutdown()
    generated = sum(len(o.outputs[0].output_ids) for o in outs)
    return {
        "what": "serve",
        "model": Path(path).name,
        "chats": chats,
        "max_batch_size": engine.max_batch_size,
        "max_model_len": engine.max_model_len,
        "kv_cache_mib": _mib(
            sum(k.numel() * k.element_size() * 2 for k in engine.runner.k_cache) // 1024
        ),
        "rss_before_load_mib": _mib(rss0),
        "rss_loaded_mib": _mib(loaded),
        "peak_rss_serving_mib": _mib(_status_kib("VmHWM")),
        "tokens_per_s": round(generated / seconds, 1),
    }


def _train_batch(vocab: int, rows: int, length: int, prompt: int, seed: int = 0):
    import torch

    from nexrl.types import Batch

    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.zeros(rows, length)
    loss_mask[:, prompt:] = 1
    return Batch(
        {
            "input_ids": torch.randint(3, vocab, (rows, length), generator=g),
            "attention_mask": torch.ones(rows, length, dtype=torch.long),
            "loss_mask": loss_mask,
            "advantages": torch.randn(rows, 1, generator=g) * loss_mask,
            "old_logprobs": -torch.rand(rows, length, generator=g) * loss_mask,
        }
    )


def train(model: str, options: dict, rows: int, length: int, steps: int) -> dict:
    """Peak RSS and seconds per `train_batch` of rows x length tokens (half prompt)."""
    from nexrl.training.torch_engine import TorchTrainEngine

    path = _model(model)
    engine = TorchTrainEngine(dict(options), path)
    config = getattr(engine.model, "config", None)  # the HF config (a Module's attribute to mypy)
    if config is None:
        raise TypeError(f"{type(engine.model).__name__} has no HF config: no vocab_size")
    vocab_size = int(config.vocab_size)
    batch = _train_batch(vocab_size, rows, length, length // 2)
    loaded = _status_kib("VmRSS")
    _reset_peak()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.train_batch(batch, "ppo_clip", {"clip_low": 0.2, "clip_high": 0.28})
        times.append(time.perf_counter() - start)
    return {
        "what": "train",
        "model": Path(path).name,
        "options": options,
        "batch": f"{rows}x{length}",
        "rss_loaded_mib": _mib(loaded),
        "peak_rss_train_mib": _mib(_status_kib("VmHWM")),
        "peak_over_loaded_mib": _mib(_status_kib("VmHWM") - loaded),
        "s_per_step": [round(t, 2) for t in times],
        "threads": int(os.environ.get("OMP_NUM_THREADS", 0)) or None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nexrl.models.measure")
    p.add_argument("what", choices=["serve", "train"])
    p.add_argument("--model", default="smollm2", help="smollm2 or any model_path")
    p.add_argument("--chats", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--options", default="{}", help="train engine options (JSON)")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args(argv)
    if args.what == "serve":
        result = serve(args.model, args.chats, args.tokens, args.max_model_len)
    else:
        result = train(args.model, json.loads(args.options), args.rows, args.length, args.steps)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
