"""Validation: one task per rollout worker vs the validation set as one batch.

A rollout worker runs one task at a time, so a validation set larger than the worker
count reached the engine in rounds. With `validate.concurrency` (default 64) each
worker runs several validation tasks side by side. This runs nexrl's validation both
ways, alternated `--repeats` times: `validate.concurrency` equal to
`rollout_worker.num_workers` (one task per worker, as before) and the default. Each
run validates before training, trains one step and validates again (the final
validation); the figure is `val/time_s`, seconds from a validation's start to its
metrics, median over the repeats. Each run has a process of its own. The headline is
the final validation's: the first one also pays the process's first forwards.

    python benchmarks/bench_validation.py             # the default task: 64 prompts, 16 workers
    python benchmarks/bench_validation.py --smollm2   # the SmolLM2 recipe: 40 questions, 8 workers
    python benchmarks/bench_validation.py --calculator  # the agent recipe: 32 questions, 2 workers
    python benchmarks/bench_validation.py --smoke   # seconds: 8 prompts (calculator: 4), 2 workers

Writes validation.md into --out (default ./bench_results; not in --smoke). Last
line: `validation_concurrency_speedup: X` (one task per worker over the default, final
validation).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import statistics
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from _machine import add_out_arguments, prepend_section, results_dir, section_head

from nexrl.config import load_config
from nexrl.controller import NexRLController

TITLE = "# Validation: one task per rollout worker vs one batch"
SMOKE = [
    "validate.data.max_items=8",
    "rollout_worker.num_workers=2",
    "rollout_worker.group_size=2",
    "trajectory_pool.batch_size=4",
    "validate.concurrency=8",
]
# the agent recipe's training step between its validations, made small (it is not timed)
CALCULATOR = ["rollout_worker.group_size=2", "trajectory_pool.batch_size=2"]
CALCULATOR_SMOKE = ["validate.data.max_items=4"]  # multi-turn SmolLM2 episodes: the slow part


def validation_times(config_name: str, overrides: list[str]) -> list[float]:
    """`val/time_s` of each validation of one run (before training, then the final one),
    in a process of its own: each run loads its model and engine afresh, and the
    SmolLM2 runs' memory would pile up in one process."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_run, config_name, overrides).result()


def _run(config_name: str, overrides: list[str]) -> list[float]:
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench_validation_") as out:  # its checkpoint
        base = [
            f"output_dir={out}",
            "train_worker.total_train_steps=1",
            "train_worker.save_freq=0",
            "weight.validate_freq=0",
            "logger.backend=[jsonl]",
        ]
        controller = NexRLController(load_config(base + overrides, config_name=config_name))
        controller.run()
        lines = Path(controller.run_dir, "metrics.jsonl").read_text().splitlines()
    return [x["val/time_s"] for x in map(json.loads, lines) if "val/time_s" in x]


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    recipe = p.add_mutually_exclusive_group()
    recipe.add_argument("--smollm2", action="store_true", help="the smollm2_arithmetic recipe")
    recipe.add_argument(
        "--calculator", action="store_true", help="the smollm2_calculator (agent) recipe"
    )
    p.add_argument("--model-path", help="model_path for the SmolLM2 recipes (default: theirs)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true")
    add_out_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    config_name = "smollm2_arithmetic" if args.smollm2 else "rl_train"
    config_name = "smollm2_calculator" if args.calculator else config_name
    extra = (SMOKE if args.smoke else []) + (CALCULATOR if args.calculator else [])
    extra += CALCULATOR_SMOKE if args.smoke and args.calculator else []
    extra += [f"model_path={args.model_path}"] if args.model_path else []
    cfg = load_config(extra, config_name=config_name)
    workers = cfg.rollout_worker.num_workers
    sides = {
        f"one task per worker (concurrency {workers})": [f"validate.concurrency={workers}"],
        f"concurrency {cfg.validate.concurrency}": [],
    }
    runs: dict[str, list[list[float]]] = {name: [] for name in sides}
    for _ in range(1 if args.smoke else args.repeats):
        for name, overrides in sides.items():  # alternated: drift moves both alike
            runs[name].append(validation_times(config_name, extra + overrides))
            print(name, [round(t, 3) for t in runs[name][-1]], flush=True)
    medians = {
        name: [statistics.median(r[i] for r in rs) for i in (0, 1)] for name, rs in runs.items()
    }
    (before, final), (after, after_final) = medians.values()
    ratios = {
        "validation_concurrency_speedup_first": before / after,
        "validation_concurrency_speedup": final / after_final,
    }
    if not args.smoke:
        write(results_dir(args) / "validation.md", config_name, medians, ratios, args.repeats)
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}")
    return ratios


def write(path: Path, config_name: str, medians, ratios, repeats: int) -> None:
    lines = [
        *section_head(f", config `{config_name}`"),
        f"torch threads: 1. Runs per side: {repeats}, alternated (figures: medians).",
        "",
        "| side | first validation s | final validation s |",
        "|---|---|---|",
        *(f"| {name} | {m[0]:.3f} | {m[1]:.3f} |" for name, m in medians.items()),
        "",
        *(f"- {k}: {v:.2f}" for k, v in ratios.items()),
        "",
    ]
    prepend_section(path, TITLE, lines)


if __name__ == "__main__":
    main()
