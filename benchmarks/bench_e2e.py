"""End to end: nexrl's default recipe vs a minimal single-file GRPO loop, back to back.

Both sides train the embedded tiny Qwen2 (`nexrl.models.tiny`) on the built-in
shift_letters task: 16 prompts x 16 samples per step, up to 4 new tokens at
temperature 1, GRPO advantages (r - group mean) / (group std + 1e-6), PPO-clip at
ratio 1 (one update per batch) with token-mean aggregation and entropy bonus 0.03,
AdamW lr 3e-4, grad clip 1.0 - the default config. The minimal loop below is the
floor: HF `generate`, reward, one torch forward / backward / step, nothing else.
Both run on the process's torch thread count (torch's default, the cores; `--threads
N` sets it): the minimal loop computes with it, and nexrl's engine and trainer follow
their own `threads` rule (one thread for a model under 1M parameters on a CPU,
docs/training.md). Runs before 2026-11-27 set one thread for the whole process, which
slowed the minimal loop more than nexrl (its update took 0.106-0.124 s on two threads
of 2 cores and 0.145-0.153 s on one).

Runs, one after the other in one process: minimal loop, nexrl sync, nexrl
fully-async (staleness 1, in-flight weight updates) with the trainer in this process
(`service.train_service.backend=builtin`), and the same fully-async with the trainer
in a child process (`process`, what fully-async picks by default); with several
seeds, seed by seed (each seed's four runs back to back), so a machine whose speed
drifts during the benchmark moves every side alike. Validation is off on the nexrl
side so both report the same thing: median seconds per step and the seconds (sum of
step times, start-up excluded) until the train reward, averaged over the last 5
steps, first reaches 0.9; and, with each side's start-up counted, its start-up (from
the start of the run, before the model loads, to its first step) and the wall-clock
to 0.9 (nexrl's from the `time` of its metrics lines). The split: "rollout s" is HF
`generate` in the minimal loop and `timing/wait_s` (the wait for the batch) on the
nexrl side; "update s" is the forward / backward / optimizer step (`timing/update_s`).

    python benchmarks/bench_e2e.py                # until 0.9 or 600 steps each
    python benchmarks/bench_e2e.py --steps 60     # a partial run: s/step ratios only
    python benchmarks/bench_e2e.py --seeds 3      # each side with seeds 42, 43, 44: medians
    python benchmarks/bench_e2e.py --smoke        # seconds: 2 tiny steps of each side
    python benchmarks/bench_e2e.py --device cuda  # both sides on a GPU: results/e2e_cuda.md
    python benchmarks/bench_e2e.py --model micro --steps 150  # host overhead: e2e_micro.md

`--model micro` trains a 1-layer, 16-wide Qwen2 with the same tokenizer instead (it
does not learn the task): its arithmetic is next to nothing, so each side's step is
what its Python and torch's dispatch cost around the model. That is the regime of a
small model on a GPU, where the tiny model's kernels take less time than launching
them, so the host side of a GPU run can be worked on without a GPU.

Steps to 0.9 vary from seed to seed (sampling) and, on the nexrl side, from run to
run (asynchronous scheduling), so one run per side can move the wall-clock ratio by
20%; with `--seeds N` every figure is the median over N runs per side, and the
seconds to 0.9 of each run are listed.

Writes e2e.md into --out (default ./bench_results; not in --smoke). Last line:
`nexrl_sync_vs_minimal_step_s: X` (target <= 0.8).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _machine import add_out_arguments, prepend_section, results_dir, section_head
from transformers import AutoModelForCausalLM, AutoTokenizer

from nexrl.config import load_config
from nexrl.controller import NexRLController
from nexrl.data.tasks import write_task
from nexrl.inference.client import shutdown_local_engines
from nexrl.models.tiny import DEFAULT_MODEL_VERSION, build_tiny_qwen2, cache_dir, default_model_path
from nexrl.rewards import shift_letters

TARGET, WINDOW = 0.9, 5
TITLE = "# End to end: nexrl vs a minimal GRPO loop"
LR, CLIP, ENTROPY_COEF, GRAD_CLIP, MAX_TOKENS = 3e-4, 0.2, 0.03, 1.0, 4
PROMPTS, GROUP = 16, 16  # a step of the default recipe
NEXRL_VARIANTS = {
    "nexrl sync": ["weight.sync_mode=sync"],
    "nexrl fully-async(1)+inflight": [
        "weight.sync_mode=fully-async",
        "weight.staleness_threshold=1",
        "weight.inflight_weight_update=true",
        "service.train_service.backend=builtin",  # the trainer in this process
    ],
    # the same with the trainer in a child process: no interpreter lock shared with the
    # engine and rollout threads that run beside the update
    "nexrl fully-async(1)+inflight+trainer process": [
        "weight.sync_mode=fully-async",
        "weight.staleness_threshold=1",
        "weight.inflight_weight_update=true",
        "service.train_service.backend=process",
    ],
}


# ------------------------------------------------------------ the minimal loop


def grpo_loss(model, seqs: torch.Tensor, n_prompt: int, adv: torch.Tensor, pad_id: int):
    """PPO-clip at ratio 1 (old = detached current), token-mean, minus the entropy bonus."""
    att = (seqs != pad_id).long()
    att[:, :n_prompt] = 1
    logits = model(input_ids=seqs, attention_mask=att, use_cache=False).logits[:, :-1].float()
    logp_all = torch.log_softmax(logits, -1)
    target = seqs[:, 1:]
    lp = logp_all.gather(-1, target[..., None]).squeeze(-1)
    mask = att[:, 1:].float()
    mask[:, : n_prompt - 1] = 0
    ratio = torch.exp(lp - lp.detach())
    a = adv[:, None]
    per_token = torch.maximum(-a * ratio, -a * ratio.clamp(1 - CLIP, 1 + CLIP))
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    n = mask.sum().clamp(min=1)
    return ((per_token - ENTROPY_COEF * entropy) * mask).sum() / n


def group_advantages(
    rows: list[dict], texts: list[str], group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The minimal loop's rewards of `texts` (`group` of them per row, row by row) and
    their GRPO advantages (r - group mean) / (group std + 1e-6)."""
    rewards = torch.tensor(
        [
            shift_letters(rows[i // group]["prompt"], t, rows[i // group]["answer"])
            for i, t in enumerate(texts)
        ]
    )
    r = rewards.view(len(rows), group)
    return rewards, ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).flatten()


def minimal_grpo(
    model_path: Path,
    rows: list[dict],
    shape: tuple[int, int, int],
    seed: int,
    device: str = "cpu",
) -> list[dict[str, float]]:
    """The floor of any GRPO trainer: sample, score, normalise per group, one step.
    `shape` is (prompts, group, steps); fp32 on any device."""
    prompts, group, steps = shape
    start = time.time()  # start-up (tokenizer and model load) counts in `since_start_s`
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    pad_id = tok.pad_token_id
    history = []
    for step in range(steps):
        t0 = time.perf_counter()
        batch = [rows[(step * prompts + i) % len(rows)] for i in range(prompts)]
        ids = tok([r["prompt"] for r in batch], return_tensors="pt").input_ids.to(device)
        n_prompt = ids.shape[1]  # every prompt has the same length ("abcd>")
        model.eval()
        with torch.no_grad():
            seqs = model.generate(
                ids.repeat_interleave(group, 0),
                attention_mask=torch.ones(len(ids) * group, n_prompt, dtype=torch.long).to(device),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=MAX_TOKENS,
                pad_token_id=pad_id,
                eos_token_id=tok.eos_token_id,
            )
        t_gen = time.perf_counter() - t0
        texts = tok.batch_decode(seqs[:, n_prompt:], skip_special_tokens=True)
        rewards, adv = group_advantages(batch, texts, group)
        adv = adv.to(device)
        model.train()
        t1 = time.perf_counter()
        loss = grpo_loss(model, seqs, n_prompt, adv, pad_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        if model.device.type == "cuda":  # the step's kernels have run
            torch.cuda.synchronize(model.device)
        t2 = time.perf_counter()
        history.append(
            {
                "reward": float(rewards.mean()),
                "step_s": t2 - t0,
                "gen_s": t_gen,
                "update_s": t2 - t1,
                "since_start_s": time.time() - start,
            }
        )
        if (step + 1) % 25 == 0:
            print(f"  minimal loop step {step + 1}: reward {history[-1]['reward']:.3f}", flush=True)
        if summarise(history)["s_to_target"] is not None:
            break  # time to the target is what is measured; the rest is not needed
    return history


# ------------------------------------------------------------------ nexrl runs


def micro_model_path() -> Path:
    """A 1-layer Qwen2, 16 wide, with the embedded model's tokenizer (built once)."""
    path = cache_dir() / "models" / f"micro-qwen2-char-v{DEFAULT_MODEL_VERSION}"
    return build_tiny_qwen2(
        path, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32
    )


def nexrl_run(overrides: list[str]) -> list[dict[str, float]]:
    shutdown_local_engines()
    start = time.time()  # start-up (building the run, the engines) counts in `since_start_s`
    controller = NexRLController(load_config(overrides))
    controller.run()
    lines = Path(controller.run_dir, "metrics.jsonl").read_text().splitlines()
    train = [x for x in map(json.loads, lines) if "train/loss" in x]
    return [
        {
            "reward": x["reward/mean"],
            "step_s": x["timing/step_s"],
            "gen_s": x["timing/wait_s"],  # the rollout side, as the train worker sees it
            "update_s": x["timing/update_s"],
            "since_start_s": x["time"] - start,  # when the step's line was logged
        }
        for x in train
    ]


def summarise(history: list[dict[str, float]]) -> dict[str, Any]:
    """Median s/step (the first step, with start-up, left out), time to TARGET (the sum
    of step times, start-up excluded), start-up (from the start of the run to the first
    step's start; on the nexrl side that includes the first batch's rollouts, which the
    minimal loop counts in its first step) and wall-clock to TARGET with start-up."""
    steady = history[1:] or history[:1]
    elapsed, to_target, steps_to, wall_to = 0.0, None, None, None
    for i, h in enumerate(history):
        elapsed += h["step_s"]
        recent = [x["reward"] for x in history[max(0, i - WINDOW + 1) : i + 1]]
        if i + 1 >= WINDOW and statistics.fmean(recent) >= TARGET:
            to_target, steps_to, wall_to = elapsed, i + 1, h["since_start_s"]
            break
    return {
        "startup_s": history[0]["since_start_s"] - history[0]["step_s"],
        "wall_to_target": wall_to,
        "steps": len(history),
        "step_s": statistics.median(h["step_s"] for h in steady),
        "gen_s": statistics.median(h["gen_s"] for h in steady),
        "update_s": statistics.median(h["update_s"] for h in steady),
        "s_to_target": to_target,
        "steps_to_target": steps_to,
        "final_reward": statistics.fmean(h["reward"] for h in history[-WINDOW:]),
    }


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-key median over the runs of one side; the time to target only over the runs
    that reached it (None if fewer than half did), each run's kept in `s_to_target_runs`."""
    if len(runs) == 1:
        return {**runs[0], "s_to_target_runs": [runs[0]["s_to_target"]]}
    out: dict[str, Any] = {
        k: statistics.median(r[k] for r in runs)
        for k in ("steps", "step_s", "gen_s", "update_s", "final_reward", "startup_s")
    }
    reached = [r for r in runs if r["s_to_target"] is not None]
    enough = 2 * len(reached) >= len(runs)
    for key in ("s_to_target", "steps_to_target", "wall_to_target"):
        out[key] = statistics.median(r[key] for r in reached) if enough else None
    out["s_to_target_runs"] = [r["s_to_target"] for r in runs]
    return out


def run_sides(
    model: Path,
    rows: list[dict],
    shape: tuple[int, int, int],
    seeds: list[int],
    base: list[str],
    device: str = "cpu",
) -> dict[str, list[dict[str, Any]]]:
    """Every side's summary per seed, seed by seed (each seed's runs back to back), so
    a machine whose speed drifts during the benchmark moves every side alike."""
    sides: dict[str, list[dict[str, Any]]] = {"minimal loop": []}
    sides.update({name: [] for name in NEXRL_VARIANTS})
    for seed in seeds:
        minimal = minimal_grpo(model, rows, shape, seed, device)
        sides["minimal loop"].append(summarise(minimal))
        print(f"seed {seed} minimal loop: {sides['minimal loop'][-1]}", flush=True)
        for name, over in NEXRL_VARIANTS.items():
            sides[name].append(summarise(nexrl_run([*base, *over, f"seed={seed}"])))
            print(f"seed {seed} {name}: {sides[name][-1]}", flush=True)
        print(f"seed {seed}:", {k: v[-1]["s_to_target"] for k, v in sides.items()}, flush=True)
    return sides


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600, help="max steps per side")
    p.add_argument("--seeds", type=int, default=1, help="runs per side (seeds 42, 43, ...)")
    p.add_argument("--smoke", action="store_true", help="2 steps of 4 x 4 each, no files")
    add_out_arguments(p)
    p.add_argument("--device", default="cpu", help="cuda: the minimal loop and nexrl's engine")
    p.add_argument(
        "--model",
        choices=["tiny", "micro"],
        default="tiny",
        help="micro: next to no arithmetic, each side's host overhead (see above)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of the process (default: torch's own, the cores); nexrl's "
        "engine and trainer then follow their `threads` rule",
    )
    return p


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    prompts, group, steps = (4, 4, 2) if args.smoke else (PROMPTS, GROUP, args.steps)
    tmp = Path(tempfile.mkdtemp(prefix="bench_e2e_"))
    train_path, _ = write_task("shift_letters", tmp / "data")
    rows = [json.loads(x) for x in train_path.read_text().splitlines()]
    model = micro_model_path() if args.model == "micro" else default_model_path()
    print(f"model: {model}\ntorch threads: {torch.get_num_threads()}", flush=True)
    seeds = [42 + i for i in range(max(1, args.seeds))]
    base = [
        f"output_dir={tmp / 'out'}",
        f"train_worker.total_train_steps={steps}",
        f"trajectory_pool.batch_size={prompts * group}",
        f"rollout_worker.group_size={group}",
        "weight.validate_freq=0",
        "validate.validate_before_train=false",
        "train_worker.save_freq=0",
        "logger.backend=[jsonl]",
        f"+service.inference_service.engine.device={args.device}",  # the trainer takes a GPU
        *([f"model_path={model}"] if args.model == "micro" else []),
    ]
    sides = run_sides(model, rows, (prompts, group, steps), seeds, base, args.device)
    results = {name: median_of(runs) for name, runs in sides.items()}
    for name, result in results.items():
        print(name, result, flush=True)
    shutdown_local_engines()
    ratios = compute_ratios(results)
    if not args.smoke:
        device = "" if args.device == "cpu" else f"_{torch.device(args.device).type}"
        model_name = "_micro" if args.model == "micro" else ""
        write(results_dir(args) / f"e2e{device}{model_name}.md", results, ratios, len(seeds))
    for k, v in ratios.items():
        print(f"{k}: {'-' if v is None else f'{v:.3f}'}")
    return results


def compute_ratios(results: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    base = results["minimal loop"]
    out: dict[str, float | None] = {}
    for name in NEXRL_VARIANTS:
        out[f"nexrl_{_key(name)}_vs_minimal_s_to_0.9"] = _ratio(results[name], base, "s_to_target")
    for name in NEXRL_VARIANTS:  # the same with each side's start-up counted
        key = f"nexrl_{_key(name)}_vs_minimal_wall_to_0.9_with_startup"
        out[key] = _ratio(results[name], base, "wall_to_target")
    for name in reversed(NEXRL_VARIANTS):
        out[f"nexrl_{_key(name)}_vs_minimal_step_s"] = _ratio(results[name], base, "step_s")
    return out


def _key(name: str) -> str:
    """'nexrl fully-async(1)+inflight+trainer process' -> 'fully-async+trainer-process'."""
    return name.replace("nexrl ", "").replace("(1)+inflight", "").replace(" ", "-")


def per_seed_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """Each nexrl side's seconds to 0.9 over the same seed's minimal run, run by run."""
    base = results["minimal loop"]["s_to_target_runs"]
    out = []
    for name in NEXRL_VARIANTS:
        runs = results[name]["s_to_target_runs"]
        each = [None if a is None or b is None else a / b for a, b in zip(runs, base, strict=True)]
        out.append(
            f"- {name}, s to 0.9 / the same seed's minimal run: "
            + ", ".join(_fmt(x, 2) for x in each)
        )
    return out


def _ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
    return None if a[key] is None or b[key] is None else a[key] / b[key]


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def write(
    path: Path, results: dict[str, dict[str, Any]], ratios: dict[str, Any], seeds: int
) -> None:
    load = " ".join(f"{x:.2f}" for x in __import__("os").getloadavg())
    lines = [
        *section_head(),
        f"Load average at the end: {load}. torch threads: {torch.get_num_threads()} (the "
        "minimal loop; nexrl's engine and trainer: their `threads` rule). Runs per side: "
        f"{seeds} (figures: medians over them).",
        "",
        "| run | steps | median s/step | rollout s | update s | steps to 0.9 | s to 0.9 "
        "| s to 0.9 of each run | final reward (last 5) | start-up s | wall s to 0.9 with it |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        each = ", ".join(_fmt(x) for x in r["s_to_target_runs"])
        lines.append(
            f"| {name} | {r['steps']:.0f} | {r['step_s']:.3f} | {r['gen_s']:.3f} | "
            f"{r['update_s']:.3f} | {_fmt(r['steps_to_target'], 0)} | "
            f"{_fmt(r['s_to_target'])} | {each} | {r['final_reward']:.3f} | "
            f"{r['startup_s']:.1f} | {_fmt(r['wall_to_target'])} |"
        )
    lines += ["", *(f"- {k}: {'-' if v is None else f'{v:.3f}'}" for k, v in ratios.items())]
    lines += [*per_seed_lines(results), ""]
    prepend_section(path, TITLE, lines)


if __name__ == "__main__":
    main()
