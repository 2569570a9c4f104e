"""Benchmark: sync vs batch-async vs fully-async (with / without partial rollout).

    python benchmarks/bench_async.py            # ~10 minutes
    python benchmarks/bench_async.py --quick    # < 2 minutes

Two tasks: the default `shift_letters` and a long-tailed variant (word lengths
drawn with P(len) ~ 1/len^2 from 2..12, so response lengths have a long tail).
Each schedule trains the embedded tiny Qwen2 for a fixed number of steps (the
0.9 validation reward takes ~225 steps of batch 128, far beyond a 10-minute
budget on 2 shared cores, so every variant runs the same fixed steps and we
report its final `val/reward`), first on the plain CPU engine, then on
`DelayedEngine` (a sleep per engine step, nexrl/rollout/emulation.py) so that
generation behaves like a separate accelerator running beside the trainer.

Reported per run: trained samples/s over the steady state (steps 2..N, from
`timing/step_s` in metrics.jsonl, so start-up is excluded), wall-clock of the
run, final val/reward, max staleness, aborts / drops / continuations. The last
line is `fully_async_vs_sync_emulated: X` = samples/s of fully-async (partial
rollout) / sync on the default task with the emulated engine.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from nexrl.config import load_config
from nexrl.controller import NexRLController
from nexrl.data import shift_word
from nexrl.inference import client as inference_client
from nexrl.models.tiny import build_tiny_qwen2
from nexrl.rollout.emulation import DelayedEngine

VARIANTS: dict[str, list[str]] = {
    "sync": ["weight.sync_mode=sync"],
    "batch-async(1)": ["weight.sync_mode=batch-async", "weight.staleness_threshold=1"],
    "fully-async(1)": ["weight.sync_mode=fully-async", "weight.staleness_threshold=1"],
    "fully-async(1)+partial": [
        "weight.sync_mode=fully-async",
        "weight.staleness_threshold=1",
        "weight.enable_partial_rollout=true",
    ],
    "fully-async(2)+partial,sync_every=2": [
        "weight.sync_mode=fully-async",
        "weight.staleness_threshold=2",
        "weight.sync_every=2",
        "weight.enable_partial_rollout=true",
    ],
}
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def write_long_tail_task(directory: Path, n_train: int = 2048, n_val: int = 32) -> list[str]:
    """Shift-letters rows with word lengths ~ 1/len^2 on 2..12 (a long tail of long answers)."""
    rng = random.Random(0)
    lengths = list(range(2, 13))
    weights = [1 / n**2 for n in lengths]
    paths = []
    for name, n in (("train", n_train), ("val", n_val)):
        rows = []
        for _ in range(n):
            word = "".join(rng.choice(LETTERS) for _ in range(rng.choices(lengths, weights)[0]))
            rows.append({"prompt": word + ">", "answer": shift_word(word)})
        path = directory / f"long_tail_{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(str(path))
    return [
        f"data.path={paths[0]}",
        f"validate.data.path={paths[1]}",
        "rollout_worker.max_tokens=14",
    ]


def base_overrides(out: Path, model: Path, steps: int) -> list[str]:
    return [
        f"output_dir={out}",
        f"model_path={model}",
        "rollout_worker.num_workers=8",
        "rollout_worker.group_size=4",
        "trajectory_pool.batch_size=32",
        f"train_worker.total_train_steps={steps}",
        "train_worker.save_freq=0",
        "weight.validate_freq=0",
        "validate.validate_before_train=false",
        "validate.data.max_items=32",
        "logger.backend=[jsonl]",
    ]


def install_engine(model: Path, delay_s: float) -> None:
    """Make the next run's in-process engine a `DelayedEngine` (or a fresh plain one).

    Builders create engines through the process-wide registry of
    `nexrl.inference.client`; pre-registering the "default" tag is the one way to
    hand the run a different engine class without a config key for it.
    """
    inference_client.shutdown_local_engines()
    if delay_s > 0:
        engine = DelayedEngine(model, step_delay_s=delay_s, max_batch_size=64)
        inference_client._local_engines["default"] = engine


def run_once(overrides: list[str]) -> dict[str, Any]:
    controller = NexRLController(load_config(overrides))
    t0 = time.perf_counter()
    final = controller.run()
    wall = time.perf_counter() - t0
    lines = [
        json.loads(x) for x in (Path(controller.run_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    train = [x for x in lines if "train/loss" in x]
    steady = sum(x["timing/step_s"] for x in train[1:])
    samples = 32 * (len(train) - 1)
    counters = controller.activity_tracker.get_counters()
    return {
        "samples_per_s": samples / steady if steady > 0 else float("nan"),
        "wall_s": wall,
        "val_reward": final.get("val/reward", float("nan")),
        "staleness_max": max(x["staleness/max"] for x in train),
        "staleness_mean": statistics.fmean(x["staleness/mean"] for x in train),
        "aborts": counters.get("rollout/aborted_groups", 0),
        "continuations": counters.get("rollout/partial_continuations", 0),
        "stale_drops": counters.get("staleness/dropped", 0),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (< 2 minutes)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--delay", type=float, default=0.015, help="emulated s per engine step")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--repeats", type=int, default=None, help="best-of-N (default 2, quick 1)")
    args = parser.parse_args(argv)
    steps = args.steps or (5 if args.quick else 30)
    args.repeats = args.repeats or (1 if args.quick else 2)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="bench_async_"))
    model = build_tiny_qwen2(tmp / "model")
    tasks = {"default": [], "long_tail": write_long_tail_task(tmp)}
    runs: list[dict[str, Any]] = []
    for rep in range(args.repeats):  # interleaved: load from other users hits every variant
        for engine_kind, delay in (("cpu", 0.0), ("emulated", args.delay)):
            for task, task_over in tasks.items():
                for name, over in VARIANTS.items():
                    install_engine(model, delay)
                    res = run_once([*base_overrides(tmp / "out", model, steps), *task_over, *over])
                    res.update(engine=engine_kind, task=task, variant=name, rep=rep)
                    runs.append(res)
                    print(_row(res), flush=True)
    inference_client.shutdown_local_engines()
    results = _best(runs)
    ratios = _ratios(results)
    for key, value in ratios.items():
        if key != "fully_async_vs_sync_emulated":
            print(f"{key}: {value:.2f}")
    _write(args.out, results, ratios, steps, args.delay, args.quick)
    print(f"fully_async_vs_sync_emulated: {ratios['fully_async_vs_sync_emulated']:.2f}")
    return 0


def _best(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (engine, task, variant): the repeat with the highest samples/s (best-of-N:
    the least disturbed by other processes on a shared machine)."""
    best: dict[tuple, dict[str, Any]] = {}
    for r in runs:
        key = (r["engine"], r["task"], r["variant"])
        if key not in best or r["samples_per_s"] > best[key]["samples_per_s"]:
            best[key] = r
    return list(best.values())


def _pick(results: list[dict[str, Any]], engine: str, task: str, variant: str) -> dict[str, Any]:
    return next(
        r for r in results if (r["engine"], r["task"], r["variant"]) == (engine, task, variant)
    )


def _ratios(results: list[dict[str, Any]]) -> dict[str, float]:
    out = {}
    for engine in ("cpu", "emulated"):
        for task in ("default", "long_tail"):
            sync = _pick(results, engine, task, "sync")["samples_per_s"]
            for variant in list(VARIANTS)[1:]:
                fast = _pick(results, engine, task, variant)["samples_per_s"]
                out[f"{engine}/{task}/{variant}_vs_sync"] = fast / sync
    out["fully_async_vs_sync_emulated"] = out["emulated/default/fully-async(1)+partial_vs_sync"]
    return out


def _row(r: dict[str, Any]) -> str:
    return (
        f"| {r['engine']} | {r['task']} | {r['variant']} | {r['samples_per_s']:.1f} | "
        f"{r['wall_s']:.1f} | {r['val_reward']:.3f} | {r['staleness_max']} | "
        f"{r['staleness_mean']:.2f} | {r['aborts']} | {r['continuations']} | {r['stale_drops']} |"
    )


def _write(out: Path, results: list, ratios: dict, steps: int, delay: float, quick: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    name = "async_quick" if quick else "async"
    (out / f"{name}.json").write_text(json.dumps({"results": results, "ratios": ratios}, indent=1))
    header = (
        "| engine | task | variant | samples/s | wall s | val/reward | stale max | stale mean "
        "| aborts | continuations | stale drops |\n|" + "---|" * 11
    )
    lines = [
        f"# bench_async ({'--quick' if quick else 'full'})",
        "",
        f"`python benchmarks/bench_async.py{' --quick' if quick else ''}`: {steps} steps of "
        f"32 samples (8 prompts x 4) per run; emulated engine sleeps {delay * 1000:.0f} ms per "
        "step. samples/s over steps 2..N, best of the interleaved repeats; val/reward after "
        "the last step (fixed steps, not time-to-0.9: see the script's docstring).",
        "",
        header,
        *(_row(r) for r in results),
        "",
        *(f"- {k}: {v:.2f}" for k, v in ratios.items()),
        "",
    ]
    (out / f"{name}.md").write_text("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
