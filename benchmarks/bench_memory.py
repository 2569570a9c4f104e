"""Memory of training: a train step as the batch grows, the largest geometry that fits,
and the SmolLM2 recipe's peak RSS against an older checkout of nexrl.

Each geometry runs in a child process of its own, so its peak resident set size
(`ru_maxrss`) is that geometry's alone: model, gradients, AdamW state, activations.
All float32, no gradient checkpointing, `TorchTrainEngine.train_batch` with the
PPO-clip loss on full-length rows whose second half is the response.

    python benchmarks/bench_memory.py --smoke     # CI: a tiny model, two geometries, seconds
    python benchmarks/bench_memory.py --scale     # SmolLM2-135M: rows x tokens
    python benchmarks/bench_memory.py --fit       # random SmolLM2-family 360M (full), 1.7B (LoRA)
    python benchmarks/bench_memory.py --grads     # SmolLM2: gradients in one block vs per parameter
    python benchmarks/bench_memory.py --engine    # generation: a joined copy vs the trainer's
    python benchmarks/bench_memory.py --recipe [--baseline DIR] [--steps 3]
        # /usr/bin/time -v nexrl train --config-name smollm2_arithmetic, DIR's tree vs this one
        # (--runs KEEP: the runs' logs and each second's RSS, rss.tsv, are kept there)

Last line: `peak_rss_gib_at_largest:` (smoke, scale, fit), `recipe_peak_rss_new_vs_old:`
or `shared_vs_copy_tokens_per_s:` (engine).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _machine import add_out_arguments, describe, prepend_section, results_dir, section_head

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
TITLE = "# Memory of training (benchmarks/bench_memory.py)"
PPO = {"clip_low": 0.2, "clip_high": 0.28}
SHAPES = {  # SmolLM2's family (the published configs' geometry; weights drawn at random)
    "135M": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3),
    "360M": dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                 num_attention_heads=15, num_key_value_heads=5),
    "1.7B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                 num_attention_heads=32, num_key_value_heads=32),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}  # fmt: skip


def random_model(shape: str):
    """A randomly initialised Llama of `SHAPES[shape]` with SmolLM2's vocabulary, built
    without running HF's per-module init (seconds, not minutes, at 1.7B)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048,
        rope_theta=10000.0, **SHAPES[shape],
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02, generator=gen)
        model.model.rotary_emb.__init__(config)  # its buffers are not parameters
    return model.tie_weights() or model


def child(spec: dict) -> dict:
    """One geometry: build, run `spec["steps"]` train steps, report peak RSS and s/step."""
    import torch

    from nexrl.training.torch_engine import TorchTrainEngine
    from nexrl.types import Batch

    torch.set_num_threads(int(spec.get("threads", os.cpu_count() or 1)))
    config = {"lr": 1e-5, "micro_batch_tokens": spec["micro_batch_tokens"]}
    if spec.get("lora"):
        config["lora"] = {"rank": 16}
    if spec["model"] == "smollm2":
        engine = TorchTrainEngine(config, "smollm2")
    else:
        engine = TorchTrainEngine(config, spec["model"], model=random_model(spec["model"]))
    if spec.get("grad_block") is False:  # --grads: per-parameter gradients, as before
        engine._zero_grads = lambda: engine.optimizer.zero_grad(set_to_none=True)
    built = _rss_now()
    rows, tokens = spec["rows"], spec["tokens"]
    vocab = engine.model.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    loss_mask = torch.zeros(rows, tokens)
    loss_mask[:, tokens // 2 :] = 1
    batch = Batch(
        {
            "input_ids": torch.randint(3, vocab, (rows, tokens), generator=g),
            "attention_mask": torch.ones(rows, tokens, dtype=torch.long),
            "loss_mask": loss_mask,
            "advantages": torch.randn(rows, 1, generator=g) * loss_mask,
        }
    )
    times = []
    for _ in range(spec["steps"]):
        start = time.perf_counter()
        engine.train_batch(batch, "ppo_clip", PPO)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    trainable = sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
    return {
        **spec,
        "params": engine._n_params,
        "trainable": trainable,
        "rss_built_gib": built / GIB,
        "peak_rss_gib": peak / GIB,
        "s_per_step": min(times[1:] or times),
    }


def _rss_now() -> int:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    return kb * 1024


def measure(spec: dict) -> dict:
    """`child(spec)` in a fresh process (its peak is its own)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"geometry {spec} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(results: list[dict]) -> list[str]:
    lines = [
        "| model | params (trainable) | rows x tokens | micro-batch tokens "
        "| RSS built (GiB) | peak RSS (GiB) | s/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lora = " LoRA" if r.get("lora") else ""
        if "grad_block" in r:
            lora += ", gradients in one block" if r["grad_block"] else ", per-parameter gradients"
        lines.append(
            f"| {r['model']}{lora} | {r['params'] / 1e6:.0f}M ({r['trainable'] / 1e6:.1f}M) "
            f"| {r['rows']} x {r['tokens']} | {r['micro_batch_tokens']} "
            f"| {r['rss_built_gib']:.2f} | {r['peak_rss_gib']:.2f} | {r['s_per_step']:.2f} |"
        )
    return lines


def grid(args) -> list[dict]:
    if args.smoke:
        return [
            dict(model="tiny", rows=r, tokens=t, micro_batch_tokens=8192, steps=2)
            for r, t in ((2, 16), (4, 32))
        ]
    if args.fit:
        tokens = args.fit_tokens
        base = dict(rows=args.fit_rows, tokens=tokens, micro_batch_tokens=tokens, steps=1)
        specs = [dict(model="360M", **base), dict(model="1.7B", lora=True, **base)]
        return [s for s in specs if not args.shapes or s["model"] in args.shapes]
    micro, steps = args.micro, args.scale_steps
    if args.grads:  # 256-token micro-batches as in the recipe, alternated; step 2 has AdamW's state
        base = dict(model="smollm2", rows=16, tokens=64, micro_batch_tokens=256, steps=2)
        return [dict(base, grad_block=b) for _ in range(2) for b in (True, False)]
    return [
        dict(model="smollm2", rows=r, tokens=t, micro_batch_tokens=micro, steps=steps)
        for r, t in args.geometries
    ]


def engine_speed(args) -> tuple[list[str], str]:
    """The recipe's generation (8 prompts x 8 samples, 46 + 16 tokens) on SmolLM2 by two
    engines in one process: one with its own weights (q/k/v and gate/up joined into a
    copy), one that took the trainer's tensors (`SharedState`: the joined matrices are
    the trainer's own, no copy). Alternated rounds; same seeds, so the same tokens; a
    first round warms both up."""
    import torch

    from nexrl.inference.engine import Engine
    from nexrl.inference.protocol import GenerationRequest, SamplingParams, WeightUpdateMeta
    from nexrl.inference.weights import SharedState
    from nexrl.models.tiny import default_model_path
    from nexrl.training.torch_engine import TorchTrainEngine

    model = str(default_model_path()) if args.smoke else "smollm2"
    trainer = TorchTrainEngine({"lr": 1e-5}, model)
    options = dict(max_batch_size=64, max_model_len=80, matmul="torch", prefix_cache_gib=0)
    engines = {
        "joined copy": Engine(model, **options),
        "trainer's tensors": Engine(model, **options),
    }
    engines["joined copy"].update_weights(WeightUpdateMeta(1, state_dict=trainer.export_weights()))
    shared = SharedState(trainer.export_weights(copy=False))
    engines["trainer's tensors"].update_weights(WeightUpdateMeta(1, state_dict=shared))
    g = torch.Generator().manual_seed(0)
    vocab = trainer.model.get_input_embeddings().weight.shape[0]
    prompts = [torch.randint(3, vocab, (46,), generator=g).tolist() for _ in range(8)]
    times: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list] = {}
    for round_ in range(args.rounds + 1):  # round 0 warms both up (not counted)
        for name, engine in engines.items():
            start = time.perf_counter()
            futures = [
                engine.submit(
                    GenerationRequest(ids, SamplingParams(16, n=8, seed=i, ignore_eos=True))
                )
                for i, ids in enumerate(prompts)
            ]
            outs = [f.result() for f in futures]
            if round_:
                times[name].append(time.perf_counter() - start)
            tokens[name] = [o.output_ids for r in outs for o in r.outputs]
    for engine in engines.values():
        engine.shutdown()
    same = tokens["joined copy"] == tokens["trainer's tensors"]
    lines = ["| engine weights | tokens/s by round | best tokens/s |", "|---|---|---|"]
    best = {}
    for name, ts in times.items():
        rates = [64 * 16 / t for t in ts]
        best[name] = max(rates)
        lines.append(f"| {name} | {', '.join(f'{r:.0f}' for r in rates)} | {best[name]:.0f} |")
    lines += ["", f"Same tokens from both engines: {same}."]
    ratio = best["trainer's tensors"] / best["joined copy"]
    return lines, f"shared_vs_copy_tokens_per_s: {ratio:.3f}"


def recipe_run(tree: Path, steps: int, out: Path, overrides: list[str]) -> dict:
    """`/usr/bin/time -v nexrl train` of the recipe with `tree` on PYTHONPATH; the RSS of
    the run is also sampled each second into `out/rss.tsv` (where in the run the peak is)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [
        "/usr/bin/time", "-v", sys.executable, "-m", "nexrl.cli", "train",
        "--config-name", "smollm2_arithmetic", f"output_dir={out}",
        f"train_worker.total_train_steps={steps}", "weight.validate_freq=3", *overrides,
    ]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(out / "log.txt", "w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tree)
        samples = _sample_rss(proc)
        wall = time.perf_counter() - start
        log.seek(0)
        text = log.read()
    (out / "rss.tsv").write_text("".join(f"{t:.0f}\t{r / GIB:.3f}\n" for t, r in samples))
    if proc.returncode != 0:
        raise RuntimeError(f"recipe run in {tree} failed:\n{text[-3000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
    vals = re.findall(r"validation at step (\d+): \{[^}]*'val/reward': ([0-9.]+)", text)
    peak_at = max(samples, key=lambda s: s[1])[0] if samples else 0.0
    return {"peak_rss_gib": rss * 1024 / GIB, "wall_s": wall, "val": vals, "peak_at_s": peak_at}


def _sample_rss(proc: subprocess.Popen) -> list[tuple[float, int]]:
    """(seconds since start, RSS of the largest process under `proc`) each second until
    it exits (a fork shares its parent's pages: summing them would count those twice)."""
    import psutil

    start, samples = time.perf_counter(), []
    while proc.poll() is None:
        try:
            tree = psutil.Process(proc.pid).children(recursive=True)  # the largest, as time -v
            rss = max((p.memory_info().rss for p in tree), default=0)  # 0: not started yet
            samples.append((time.perf_counter() - start, rss))
        except psutil.Error:
            pass
        time.sleep(1.0)
    return samples


def recipe(args) -> tuple[list[str], str]:
    new = recipe_run(ROOT, args.steps, Path(args.out) / "new", args.overrides)
    if not args.baseline:  # this tree alone
        old = None
    else:
        old = recipe_run(Path(args.baseline).resolve(), args.steps, Path(args.out) / "old", [])
    lines = [
        "| tree | peak RSS (GiB) | peak at (s) | wall (s) | held-out reward by step |",
        "|---|---|---|---|---|",
    ]
    runs = (
        (("before (" + args.baseline + ")", old), ("this tree", new))
        if old
        else [("this tree", new)]
    )
    for name, r in runs:
        val = ", ".join(f"{s}: {v}" for s, v in r["val"])
        lines.append(
            f"| {name} | {r['peak_rss_gib']:.2f} | {r['peak_at_s']:.0f} | {r['wall_s']:.0f} "
            f"| {val} |"
        )
    if old is None:
        return lines, f"recipe_peak_rss_gib: {new['peak_rss_gib']:.3f}"
    return lines, f"recipe_peak_rss_new_vs_old: {new['peak_rss_gib'] / old['peak_rss_gib']:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--scale", action="store_true")
    p.add_argument("--fit", action="store_true")
    p.add_argument("--grads", action="store_true", help="gradients in one block vs per parameter")
    p.add_argument("--fit-rows", type=int, default=8, help="rows of 256 tokens (--fit)")
    p.add_argument("--fit-tokens", type=int, default=256, help="tokens a row (--fit)")
    p.add_argument("--shape", action="append", dest="shapes", help="360M or 1.7B (--fit)")
    p.add_argument("--scale-steps", type=int, default=2, help="steps per geometry (--scale)")
    p.add_argument("--recipe", action="store_true")
    p.add_argument("--engine", action="store_true", help="generation: joined copy vs shared")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds (--engine)")
    p.add_argument("--baseline", help="a checkout of the nexrl to compare (--recipe)")
    p.add_argument("--steps", type=int, default=3, help="recipe train steps (--recipe)")
    p.add_argument("--override", action="append", dest="overrides", default=[],
                   help="a config override for this tree's run (--recipe; repeatable)")  # fmt: skip
    p.add_argument("--runs", help="keep the two runs' folders (logs, rss.tsv) here (--recipe)")
    p.add_argument("--micro", type=int, default=8192, help="micro_batch_tokens (--scale)")
    p.add_argument("--geometry", action="append", dest="geometries", default=None,
                   help="ROWSxTOKENS (--scale; repeatable)")  # fmt: skip
    p.add_argument("--child", help=argparse.SUPPRESS)
    add_out_arguments(p)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.engine:
        lines, last = engine_speed(args)
        title = ": SmolLM2 generation, the engine's joined copy vs the trainer's tensors"
    elif args.recipe:
        out = results_dir(args)
        with tempfile.TemporaryDirectory() as tmp:
            args.out = args.runs or tmp  # the two runs' folders
            lines, last = recipe(args)
        args.out, args.update_results = out, False
        title = f": the recipe's peak RSS, {args.steps} steps"
        title += ", before vs this tree" if args.baseline else ""
    else:
        geoms = args.geometries or ["16x64", "16x256", "64x64", "64x256", "16x1024"]
        args.geometries = [tuple(int(x) for x in g.split("x")) for g in geoms]
        results = [measure(spec) for spec in grid(args)]
        lines = table(results)
        last = f"peak_rss_gib_at_largest: {results[-1]['peak_rss_gib']:.2f}"
        title = ": what fits in 24 GiB" if args.fit else ": a SmolLM2-135M train step"
        title += ", the gradients' layout (two rounds)" if args.grads else ""
    if args.smoke:  # the engine comparison too, one round on the tiny model
        args.rounds = 1
        lines += ["", *engine_speed(args)[0]]
    print("\n".join(lines))
    if not args.smoke:
        head = section_head(title)
        prepend_section(results_dir(args) / "memory.md", TITLE, [*head, *lines, ""])
    print(describe())
    print(last)


if __name__ == "__main__":
    main()
