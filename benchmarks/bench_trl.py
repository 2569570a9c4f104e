"""nexrl against TRL's `GRPOTrainer` on the SmolLM2 recipe's work, in one script run.

Both sides: SmolLM2-135M-Instruct in fp32 on the CPU, the recipe's times-table train file
(chat prompts), its reward (`math`: the last number of the reply), 8 prompts x 8 samples
a step, 16 new tokens at temperature 1, lr 1e-5 constant, PPO clip 0.2 / 0.28,
token-mean loss, no KL, one update per batch. Each side runs `--steps` steps as a fresh
process; reported: seconds per step (median of the steps after the first), the wall
clock of the whole run, and the held-out accuracy before training and after every step
(greedy, the recipe's 40 held-out questions and reward: nexrl's validator on one side, a
callback with HF `generate` on TRL's, which stops TRL once `--target` is reached). The
time to `--target` (default 0.85) counts from launch, start-up included, without the
evaluations' own seconds. nexrl runs `nexrl train --config-name
smollm2_arithmetic` (validation off); TRL runs in the Python given by `--trl-python`
(a venv with `trl` and this tree importable), since TRL pins its own transformers.

    python benchmarks/bench_trl.py --smoke    # CI: tiny model, 2 steps; TRL only if importable
    python benchmarks/bench_trl.py --trl-python /work/venvs/trl/bin/python --steps 4 \\
        --update-results

Last lines: `nexrl_step_s: X` (nexrl's best mode), then with TRL `nexrl_vs_trl_step_s: X`
(nexrl's best mode / TRL, seconds per step) and, when both reach the target,
`nexrl_vs_trl_to_target: X` (nexrl's fastest mode / TRL, seconds to the target).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _machine import add_out_arguments, describe, prepend_section, results_dir, section_head

ROOT = Path(__file__).resolve().parents[1]
TITLE = "# nexrl vs TRL GRPOTrainer (benchmarks/bench_trl.py)"
MODES = {
    "sync": [],
    "fully-async": ["weight.sync_mode=fully-async", "weight.staleness_threshold=1"],
}
FULL = {"prompts": 8, "group": 8, "tokens": 16}
SMOKE = {"prompts": 2, "group": 4, "tokens": 4}


def nexrl_side(
    model: str, mode: str, work: dict, steps: int, out: Path, target: float | None
) -> dict:
    """`nexrl train` of the recipe for `steps` steps; its per-step seconds from the metrics,
    and with `target` its held-out accuracy at every step (the recipe's validator: greedy,
    the 40 held-out questions)."""
    prompts, group = work["prompts"], work["group"]
    cmd = [
        sys.executable, "-m", "nexrl.cli", "train", "--config-name", "smollm2_arithmetic",
        f"output_dir={out}", f"model_path={model}", f"train_worker.total_train_steps={steps}",
        "train_worker.save_freq=0", f"validate.validate_before_train={target is not None}",
        f"weight.validate_freq={0 if target is None else 1}", "logger.backend=[jsonl]",
        f"rollout_worker.num_workers={prompts}", f"rollout_worker.group_size={group}",
        f"trajectory_pool.batch_size={prompts * group}",
        f"rollout_worker.max_tokens={work['tokens']}",
        *MODES[mode],
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start, launched = time.perf_counter(), time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"nexrl {mode} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    rows = [json.loads(line) for f in out.rglob("metrics.jsonl") for line in f.open()]
    step_s = [
        r["timing/step_s"] for r in sorted(rows, key=lambda r: r["step"]) if "timing/step_s" in r
    ]
    if len(step_s) != steps:
        raise RuntimeError(f"nexrl {mode}: {len(step_s)} steps logged, {steps} expected")
    evals = [
        {"step": r["step"], "at_s": r["time"] - launched, "eval_s": r["val/time_s"],
         "accuracy": r["val/reward"]}
        for r in sorted(rows, key=lambda r: r["step"]) if "val/reward" in r
    ]  # fmt: skip
    return {"side": f"nexrl {mode}", "step_s": step_s, "wall_s": wall, "evals": evals}


def trl_side(
    python: str, model: str, work: dict, steps: int, files: tuple[Path, Path], target: float | None
) -> dict:
    """TRL's GRPOTrainer in `python` (`--trl-child`), timed by a callback at each step end;
    with `target`, the same callback measures the held-out accuracy as nexrl's validator
    does, and stops training once it reaches `target`."""
    spec = {"model": model, "steps": steps, "train_file": str(files[0]), **work}
    spec |= {"val_file": str(files[1]), "target": target, "launched": time.time()}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.run(
        [python, __file__, "--trl-child", json.dumps(spec)],
        capture_output=True, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"TRL failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "side": f"TRL {result['version']} GRPOTrainer",
        "step_s": result["step_s"],
        "wall_s": wall,
        "evals": result["evals"],
    }


def trl_child(spec: dict) -> dict:
    """Runs in TRL's environment: the recipe's work through `GRPOTrainer`."""
    import datasets
    import trl
    from transformers import AutoTokenizer, TrainerCallback

    from nexrl.rewards.math import math_reward

    def reward(completions: list, answer: list, **_: object) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [math_reward("", t, a)["reward"] for t, a in zip(texts, answer, strict=True)]

    val_rows = [json.loads(line) for line in Path(spec["val_file"]).read_text().splitlines()]

    class StepTimes(TrainerCallback):
        """Each step's seconds; with a target, the held-out accuracy before training and
        after every step (its seconds kept apart, not in the step's)."""

        def __init__(self) -> None:
            self.last, self.times, self.evals = time.perf_counter(), [], []

        def evaluate(self, step: int, model: object) -> float:
            start = time.perf_counter()
            accuracy = held_out_accuracy(model, tokenizer, val_rows, spec["tokens"])
            self.evals.append({
                "step": step, "at_s": time.time() - spec["launched"], "accuracy": accuracy,
                "eval_s": time.perf_counter() - start,
            })  # fmt: skip
            return accuracy

        def on_train_begin(self, args: object, state: object, control: object, **kw: Any) -> None:
            if spec["target"] is not None:
                self.evaluate(0, kw["model"])
            self.last = time.perf_counter()

        def on_step_end(self, args: object, state: Any, control: Any, **kw: Any) -> None:
            self.times.append(time.perf_counter() - self.last)
            target = spec["target"]
            if target is not None and self.evaluate(state.global_step, kw["model"]) >= target:
                control.should_training_stop = True
            self.last = time.perf_counter()

    rows = datasets.load_dataset("json", data_files=spec["train_file"], split="train")
    config = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, report_to="none",
        save_strategy="no", logging_steps=1, max_steps=spec["steps"], seed=0,
        per_device_train_batch_size=spec["prompts"] * spec["group"],
        num_generations=spec["group"], max_completion_length=spec["tokens"],
        temperature=1.0, learning_rate=1e-5, lr_scheduler_type="constant",
        epsilon=0.2, epsilon_high=0.28, beta=0.0, loss_type="dapo", max_grad_norm=1.0,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    tokenizer.model_input_names = ["input_ids", "attention_mask"]  # the tiny one adds types
    timer = StepTimes()
    trainer = trl.GRPOTrainer(
        model=spec["model"], reward_funcs=reward, args=config, train_dataset=rows,
        processing_class=tokenizer, callbacks=[timer],
    )  # fmt: skip
    trainer.train()
    return {"version": trl.__version__, "step_s": timer.times, "evals": timer.evals}


def held_out_accuracy(model: Any, tokenizer: Any, rows: list[dict], max_tokens: int) -> float:
    """Greedy replies to the held-out chat prompts, scored by the recipe's `math` reward:
    what nexrl's validator does (validate.temperature=0, the same template and reward)."""
    import torch

    from nexrl.rewards.math import math_reward

    texts = [
        tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
        for r in rows
    ]
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    tokenizer.padding_side = side
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(
            **batch, max_new_tokens=max_tokens, do_sample=False,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        )  # fmt: skip
    model.train(was_training)
    new_tokens = out[:, batch["input_ids"].shape[1] :]
    replies = tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    scores = [math_reward("", t, r["answer"])["reward"] for t, r in zip(replies, rows, strict=True)]
    return sum(scores) / len(scores)


def trl_available(python: str) -> bool:
    proc = subprocess.run([python, "-c", "import trl"], capture_output=True, env=os.environ)
    return proc.returncode == 0


def median_step(r: dict) -> float:
    return statistics.median(r["step_s"][1:] or r["step_s"])


def to_target(r: dict, target: float) -> float | None:
    """Seconds from launch to the first held-out accuracy >= `target`, start-up included and
    the evaluations' own seconds left out (each side measures alike); None: not reached."""
    spent = 0.0
    for e in r.get("evals", []):
        spent += e["eval_s"]
        if e["accuracy"] >= target:
            return e["at_s"] - spent
    return None


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def table(results: list[dict], trl: dict | None, target: float) -> list[str]:
    lines = [
        "| side | s/step (median after the first) | first step (s) | wall (s) | held-out by step "
        f"| to held-out {target} (s) | vs TRL s/step | vs TRL to {target} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    trl_target = to_target(trl, target) if trl else None
    for r in results:
        curve = " ".join(f"{e['accuracy']:.3g}" for e in r.get("evals", [])) or "-"
        reached = to_target(r, target)
        lines.append(
            f"| {r['side']} | {median_step(r):.2f} | {r['step_s'][0]:.2f} | {r['wall_s']:.0f} "
            f"| {curve} | {'-' if reached is None else f'{reached:.0f}'} "
            f"| {_ratio(median_step(r), median_step(trl) if trl else None)} "
            f"| {_ratio(reached, trl_target)} |"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--modes", nargs="+", default=None, choices=list(MODES),
                   help="nexrl's modes (default: both; --smoke: sync)")  # fmt: skip
    p.add_argument("--trl-python", default=sys.executable, help="a Python with trl installed")
    p.add_argument("--target", type=float, default=0.85, help="held-out accuracy to time")
    p.add_argument("--trl-child", help=argparse.SUPPRESS)
    add_out_arguments(p)
    args = p.parse_args()
    if args.trl_child:
        print(json.dumps(trl_child(json.loads(args.trl_child))))
        return
    sys.path.insert(0, str(ROOT))
    from nexrl.data.tasks import write_task
    from nexrl.models.sources import smollm2_dir
    from nexrl.models.tiny import cache_dir, default_model_path

    work, steps = (SMOKE, 2) if args.smoke else (FULL, args.steps)
    modes = args.modes or (["sync"] if args.smoke else list(MODES))
    model = str(default_model_path() if args.smoke else smollm2_dir())
    files = write_task("times_tables", cache_dir() / "data")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            results.append(nexrl_side(model, mode, work, steps, Path(tmp) / mode, args.target))
    trl = None
    if trl_available(args.trl_python):
        trl = trl_side(args.trl_python, model, work, steps, files, args.target)
    else:
        print(f"TRL side skipped: `import trl` fails in {args.trl_python} (see --trl-python)")
    lines = table([*results, *([trl] if trl else [])], trl, args.target)
    print("\n".join(lines))
    best = min(results, key=median_step)
    if not args.smoke:
        head = section_head(
            f": {steps} steps, {work['prompts']} x {work['group']} x {work['tokens']}"
        )
        prepend_section(results_dir(args) / "trl.md", TITLE, [*head, *lines, ""])
    print(describe())
    print(f"nexrl_step_s: {median_step(best):.3f} ({best['side']})")
    if trl:
        print(f"nexrl_vs_trl_step_s: {median_step(best) / median_step(trl):.3f}")
        reached = [t for t in (to_target(r, args.target) for r in results) if t is not None]
        trl_reached = to_target(trl, args.target)
        if reached and trl_reached:
            print(f"nexrl_vs_trl_to_target: {min(reached) / trl_reached:.3f}")


if __name__ == "__main__":
    main()
