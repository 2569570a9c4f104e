"""Train tokens/s of `TorchTrainEngine` vs a bare torch loop, same model and batch, one run.

The bare loop is the floor of any trainer: forward, masked token-mean policy-gradient
loss, backward, AdamW step (no clipping, no metrics, no micro-batching). The engine
runs `train_batch` with the PPO-clip loss through `compute_loss`, so the ratio is the
price of everything the engine adds. The two are interleaved round by round so that
load from other processes on a shared machine hits both alike.
On a GPU both sides use the engine's autocast for the batch (`dtype: auto`: bf16 from 1e11
FLOPs, fp32 below) and the clock is read after the GPU is done.

    python benchmarks/bench_training.py [--batch 16 --seq 128 --rounds 5 --steps 3]
    python benchmarks/bench_training.py --smoke   # seconds: tiny sizes, same code path

Last line: `engine_vs_bare_loop: X` (engine tokens/s / bare tokens/s; target >= 0.9).
`old_logprob_pass_vs_train_step` is the no-grad old-logprob pass over one train step:
what skipping it on-policy saves on the train side. `vocab_projection_vs_checkpointed`:
forward + backward through an output layer of `--proj-vocab` tokens for `--proj-rows`
positions, autograd under activation checkpointing (the chunked logprobs before
`nexrl/training/vocab_projection.py`) over the engine's own backward (>1: faster).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from _machine import add_out_arguments, describe, results_dir
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM

from nexrl.models.tiny import build_tiny_qwen2
from nexrl.training.microbatch import _project
from nexrl.training.synthetic import random_batch
from nexrl.training.torch_engine import TorchTrainEngine
from nexrl.training.vocab_projection import projected_logprobs
from nexrl.types import Batch

PPO = {"clip_low": 0.2, "clip_high": 0.28}


def bare_step(model, opt, ids, att, mask, adv) -> None:
    logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = -(lp * adv[:, 1:] * mask[:, 1:]).sum() / mask.sum().clamp(min=1)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def full_batch(n: int, t: int, vocab_size: int) -> Batch:
    """Every row of full length: padding gives neither side an advantage. Token ids
    are drawn from the model's own vocabulary (a fixed bound broke when it shrank)."""
    batch = random_batch(n, t, seed=0)
    g = torch.Generator().manual_seed(1)
    batch.values["input_ids"] = torch.randint(3, vocab_size, (n, t), generator=g)
    batch.values["attention_mask"] = torch.ones(n, t, dtype=torch.long)
    batch.values["loss_mask"] = torch.zeros(n, t)
    batch.values["loss_mask"][:, t // 4 :] = 1
    batch.values["advantages"] = torch.randn(n, 1, generator=g) * batch.values["loss_mask"]
    batch.values["old_logprobs"] = torch.zeros(n, t)
    return batch


def projection_ratio(rows: int, hidden: int, vocab: int, rounds: int) -> float:
    """Seconds of forward + backward through the output layer, checkpointed autograd over
    `projected_logprobs`, interleaved round by round (>1: the engine's is faster)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=gen).requires_grad_()
    head = (torch.randn(vocab, hidden, generator=gen) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    cpu = torch.device("cpu")

    def old():
        checkpoint(_project, x, head, targets, False, use_reentrant=False)[0].sum().backward()

    def new():
        projected_logprobs(x, head, targets)[0].sum().backward()

    t_old = t_new = 0.0
    for _ in range(rounds):
        t_old += timed(old, 1, cpu)
        t_new += timed(new, 1, cpu)
    return t_old / t_new


def timed(fn, steps: int, device: torch.device) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    if device.type == "cuda":  # kernels run after their launch returns
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--proj-rows", type=int, default=512)
    p.add_argument("--proj-hidden", type=int, default=576)
    p.add_argument("--proj-vocab", type=int, default=49152)  # SmolLM2's output layer
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round (seconds)")
    add_out_arguments(p)
    return p


def main(argv: list[str] | None = None) -> float:
    args = parser().parse_args(argv)
    if args.smoke:
        args.batch, args.seq, args.hidden, args.layers, args.rounds, args.steps = 2, 16, 32, 1, 1, 1
        args.proj_rows, args.proj_hidden, args.proj_vocab = 8, 32, 64
    torch.set_num_threads(args.threads)
    path = build_tiny_qwen2(
        tempfile.mkdtemp() + "/m",
        hidden_size=args.hidden,
        num_layers=args.layers,
        intermediate_size=2 * args.hidden,
    )
    engine = TorchTrainEngine(
        {"micro_batch_tokens": args.batch * args.seq, "grad_clip": 1.0}, str(path)
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(engine.device)
    batch = full_batch(args.batch, args.seq, model.config.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    v = {k: t.to(engine.device) for k, t in batch.values.items()}

    def run_engine():
        engine.train_batch(batch, "ppo_clip", PPO)

    # the engine's mixed precision (bf16 autocast on a GPU for a batch this size by
    # default), the bare loop's too
    dtype = engine.autocast_dtype(args.batch * args.seq)
    autocast = dtype is not None
    bare_args = [v[k] for k in ("input_ids", "attention_mask", "loss_mask", "advantages")]

    def run_bare():
        with torch.autocast(engine.device.type, dtype=dtype, enabled=autocast):
            bare_step(model, opt, *bare_args)

    def run_old_logprobs():  # the pass an on-policy engine can skip (docs/performance.md)
        engine.compute_logprobs(batch)

    for fn in (run_engine, run_bare, run_old_logprobs):  # warm up
        timed(fn, 1, engine.device)
    t_engine = t_bare = t_old = 0.0
    for _ in range(args.rounds):
        t_engine += timed(run_engine, args.steps, engine.device)
        t_bare += timed(run_bare, args.steps, engine.device)
        t_old += timed(run_old_logprobs, args.steps, engine.device)
    tokens = args.batch * args.seq * args.steps * args.rounds
    proj = projection_ratio(args.proj_rows, args.proj_hidden, args.proj_vocab, args.rounds)
    lines = [
        f"device: {engine.device}  threads: {args.threads}  model: hidden {args.hidden} x "
        f"{args.layers} layers  batch: {args.batch} x {args.seq}  "
        f"autocast: {dtype or 'off'}",
        f"engine_tokens_per_s: {tokens / t_engine:.1f}",
        f"bare_loop_tokens_per_s: {tokens / t_bare:.1f}",
        f"old_logprob_pass_vs_train_step: {t_old / t_engine:.3f}",
        f"vocab_projection_vs_checkpointed ({args.proj_rows} x {args.proj_hidden} x "
        f"{args.proj_vocab}): {proj:.3f}",
        f"engine_vs_bare_loop: {t_bare / t_engine:.3f}",
    ]
    print("\n".join(lines))
    if not args.smoke:
        out = results_dir(args)
        out.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        title = f"# Train engine vs a bare loop\n\n## Run of {stamp}\n\n"
        text = f"{title}{describe()}\n```\n" + "\n".join(lines) + "\n```\n"
        (out / "training.md").write_text(text)
    return t_bare / t_engine


if __name__ == "__main__":
    main()
