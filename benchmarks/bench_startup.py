"""Start-up of `nexrl train`: seconds from launching the command to its first train step.

    python benchmarks/bench_startup.py                 # 3 rounds per backend: results/startup.md
    python benchmarks/bench_startup.py --device cuda   # the engine and trainer on a GPU
    python benchmarks/bench_startup.py --smoke         # seconds: one round, one tiny step

Every run is a fresh process, as a user starts one: its imports, the model loads, the
engine start and the first batch's rollouts all count. Two trainer backends, both in
fully-async training with in-flight weight updates (bench_e2e.py's fastest modes):
`builtin` (the trainer in the run's process) and `process` (a child process of its own,
whose imports of torch and transformers are the longest part of its start-up: `nexrl
train` spawns it before importing the rest of the run, so that the two overlap).
The runs alternate between the backends, so drift in the machine's speed moves both.

Writes startup{_cuda}.md into --out (default ./bench_results; not in --smoke).
Last line: `process_vs_builtin_first_step: X`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _machine import add_out_arguments, prepend_section, results_dir, section_head

TITLE = "# Start-up: from launching `nexrl train` to its first step"
LAUNCH = "import sys; from nexrl.cli import main; sys.exit(main())"  # what `nexrl` runs
BASE = [
    "weight.sync_mode=fully-async",
    "weight.staleness_threshold=1",
    "weight.inflight_weight_update=true",
    "weight.validate_freq=0",
    "validate.validate_before_train=false",
    "train_worker.save_freq=0",
    "logger.backend=[jsonl]",
]
BACKENDS = ("builtin", "process")


def one_run(backend: str, overrides: list[str]) -> dict[str, float]:
    """A fresh `nexrl train`: seconds from its launch to its first step's start and end,
    and to its exit."""
    out = Path(tempfile.mkdtemp(prefix="bench_startup_"))
    args = [*BASE, *overrides, f"output_dir={out}", f"service.train_service.backend={backend}"]
    launch = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", LAUNCH, "train", "--log-level", "WARNING", *args],
        capture_output=True,
        text=True,
    )
    ended = time.time() - launch
    if proc.returncode != 0:
        raise SystemExit(f"nexrl train ({backend}) failed:\n{proc.stderr[-3000:]}")
    lines = next(out.rglob("metrics.jsonl")).read_text().splitlines()
    first = next(x for x in map(json.loads, lines) if "train/loss" in x)
    step_end = first["time"] - launch
    return {
        "first_step_start": step_end - first["timing/step_s"],
        "first_step_end": step_end,
        "exit": ended,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="runs per backend, alternated")
    p.add_argument("--steps", type=int, default=3, help="train steps per run")
    p.add_argument("--smoke", action="store_true", help="one round of one 4 x 4 step, no file")
    add_out_arguments(p)
    p.add_argument("--device", default="cpu", help="cuda: the engine and the trainer on a GPU")
    return p


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    args = parser().parse_args(argv)
    rounds, steps = (1, 1) if args.smoke else (args.rounds, args.steps)
    overrides = [f"train_worker.total_train_steps={steps}"]
    if args.smoke:
        overrides += ["trajectory_pool.batch_size=16", "rollout_worker.group_size=4"]
    if args.device != "cpu":
        overrides.append(f"+service.inference_service.engine.device={args.device}")
    runs: dict[str, list[dict[str, float]]] = {b: [] for b in BACKENDS}
    for r in range(rounds):
        for backend in BACKENDS:
            runs[backend].append(one_run(backend, overrides))
            print(f"round {r} {backend}: {runs[backend][-1]}", flush=True)
    results = {b: {k: statistics.median(x[k] for x in v) for k in v[0]} for b, v in runs.items()}
    ratio = results["process"]["first_step_start"] / results["builtin"]["first_step_start"]
    if not args.smoke:
        suffix = "" if args.device == "cpu" else "_cuda"
        write(results_dir(args) / f"startup{suffix}.md", results, runs, ratio)
    print(f"process_vs_builtin_first_step: {ratio:.3f}")
    return results


def write(path: Path, results: dict, runs: dict, ratio: float) -> None:
    lines = [
        *section_head(),
        f"Runs per backend: {len(runs['builtin'])}, alternated (figures: medians).",
        "",
        "| trainer backend | launch to first step's start s | to its end s | to exit s "
        "| first step's start, each run |",
        "|---|---|---|---|---|",
    ]
    for backend, r in results.items():
        each = ", ".join(f"{x['first_step_start']:.2f}" for x in runs[backend])
        lines.append(
            f"| {backend} | {r['first_step_start']:.2f} | {r['first_step_end']:.2f} | "
            f"{r['exit']:.2f} | {each} |"
        )
    lines += ["", f"- process_vs_builtin_first_step: {ratio:.3f}", ""]
    prepend_section(path, TITLE, lines)


if __name__ == "__main__":
    main()
