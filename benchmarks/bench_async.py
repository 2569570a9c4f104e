"""Benchmark: sync vs batch-async vs fully-async (with / without partial rollout).

    python benchmarks/bench_async.py            # ~30 minutes on 2 CPU cores
    python benchmarks/bench_async.py --quick    # < 3 minutes, fixed short runs
    python benchmarks/bench_async.py --smoke    # seconds: every variant, 2 tiny steps
    python benchmarks/bench_async.py --only emulated/long_tail --latency 0.033 --steps 40
                                                # one engine and task: async_emulated_long_tail.md

Two tasks, each variant in the same process one after the other:

- `default`: the default recipe of `nexrl train` (500 steps of 16 prompts x 16
  samples, validation every 25 steps). Reported: trained samples/s over the
  steady state, train-seconds and steps until `val/reward` first reaches 0.9
  (train-seconds = sum of `timing/step_s`, so validation pauses and start-up
  are excluded), and the final `val/reward`.
- `long_tail`: shift-letters with word lengths drawn with P(len) ~ 1/len^2 from
  2..12, so a few responses are 3-6x longer than most. It learns far slower
  than the default task (val 0.19 after 250 steps), so it runs a fixed number
  of steps and reports samples/s, aborts and continuations.

Every schedule runs twice: on the CPU engine (generation and training share
the 2 cores), then on the built-in engine with `emulated_step_latency_s`, a
sleep per engine step, so that generation behaves like an accelerator beside
the trainer (docs/async.md, "Emulated accelerator"). The latency is calibrated
so that generating a batch takes about as long as training it: it is the CPU
sync run's median train time divided by the engine steps of one batch
(prefill + max_tokens decode steps). A short sweep at half and double that
latency shows how the gain depends on the balance.

Both runs use the default 16 rollout workers and 256-row engine batch, so one batch
of groups generates as one wave (a GPU engine is given the whole batch too).
The last line is `fully_async_vs_sync_emulated: X`: samples/s of fully-async
(staleness 1) over sync, default task, emulated engine.
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
from _machine import add_out_arguments, describe, record, results_dir

from nexrl.config import load_config
from nexrl.controller import NexRLController
from nexrl.data import shift_word
from nexrl.inference.client import shutdown_local_engines
from nexrl.models.tiny import build_tiny_qwen2

VARIANTS: dict[str, list[str]] = {
    "sync": ["weight.sync_mode=sync"],
    "batch-async(1)": ["weight.sync_mode=batch-async", "weight.staleness_threshold=1"],
    # the fully-async default: pushes swap weights under running requests (in-flight)
    "fully-async(1)": ["weight.sync_mode=fully-async", "weight.staleness_threshold=1"],
    # pushes abort what still runs after `abort_grace_s` (1 s) and the task starts over
    "fully-async(1)+abort": [
        "weight.sync_mode=fully-async",
        "weight.staleness_threshold=1",
        "weight.inflight_weight_update=false",
        "weight.enable_partial_rollout=false",
    ],
    # the same, aborting at once (xtuner's async 1 without over-sending)
    "fully-async(1)+abort(0s)": [
        "weight.sync_mode=fully-async",
        "weight.staleness_threshold=1",
        "weight.inflight_weight_update=false",
        "weight.enable_partial_rollout=false",
        "weight.abort_grace_s=0",
    ],
    "fully-async(1)+partial": [
        "weight.sync_mode=fully-async",
        "weight.staleness_threshold=1",
        "weight.enable_partial_rollout=true",
    ],
}
HEADLINE = "fully-async(1)"
TARGET = 0.9
SMOKE = ["trajectory_pool.batch_size=8", "rollout_worker.group_size=4"]
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def write_long_tail_task(directory: Path, n_train: int = 2048, n_val: int = 64) -> list[str]:
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


def task_overrides(task: str, tmp: Path, steps: int | None) -> list[str]:
    """The default recipe as is (steps=None), or a fixed short run without validation."""
    over = [] if task == "default" else write_long_tail_task(tmp)
    if steps is not None:
        over += [
            f"train_worker.total_train_steps={steps}",
            "weight.validate_freq=0",
            "validate.validate_before_train=false",
        ]
    return over


def run_once(overrides: list[str]) -> dict[str, Any]:
    # every variant trains in this process, as when the results below were recorded: the
    # rollout policies are compared, not where the trainer runs (bench_e2e.py does that)
    overrides = ["service.train_service.backend=builtin", *overrides]
    controller = NexRLController(load_config(overrides))
    t0 = time.perf_counter()
    final = controller.run()
    wall = time.perf_counter() - t0
    lines = [
        json.loads(x) for x in (Path(controller.run_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    train = [x for x in lines if "train/loss" in x]
    steady = train[1:]  # the first step includes start-up
    samples = sum(x["train/num_seqs"] for x in steady)
    counters = controller.activity_tracker.get_counters()
    return {
        "samples_per_s": samples / sum(x["timing/step_s"] for x in steady),
        "train_s": statistics.median(x["timing/train_s"] for x in steady),
        "wall_s": wall,
        **time_to_target(lines),
        "val_reward": final.get("val/reward", float("nan")),
        "staleness_max": max(x["staleness/max"] for x in train),
        "staleness_mean": statistics.fmean(x["staleness/mean"] for x in train),
        "aborts": counters.get("rollout/aborted_groups", 0),
        "continuations": counters.get("rollout/partial_continuations", 0),
        "stale_drops": counters.get("staleness/dropped", 0),
    }


def time_to_target(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Steps and train-seconds until the first validation at or above TARGET (None: never)."""
    elapsed = 0.0
    for x in lines:
        elapsed += x.get("timing/step_s", 0.0)
        if x.get("val/reward", 0.0) >= TARGET and x["step"] > 0:
            return {"steps_to_target": x["step"], "train_s_to_target": elapsed}
    return {"steps_to_target": None, "train_s_to_target": None}


def run_variants(base: list[str], latency: float, names: list[str]) -> dict[str, dict[str, Any]]:
    results = {}
    for name in names:
        shutdown_local_engines()  # a fresh engine per run (the latency is an engine option)
        over = [*base, f"+service.inference_service.engine.emulated_step_latency_s={latency}"]
        results[name] = run_once([*over, *VARIANTS[name]])
        print(_row("", "", name, results[name]), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fixed short runs (< 3 minutes)")
    parser.add_argument("--latency", type=float, default=None, help="emulated s per engine step")
    add_out_arguments(parser)
    parser.add_argument("--smoke", action="store_true", help="2 tiny steps per variant, no files")
    parser.add_argument(
        "--only", choices=[f"{e}/{t}" for e in ENGINES for t in TASKS], default=None,
        help="one engine/task (emulated needs --latency); writes async_<engine>_<task>.*",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=None, help="fixed steps per run")
    args = parser.parse_args(argv)
    if args.only and args.only.startswith("emulated") and args.latency is None and not args.smoke:
        parser.error("--only emulated/... needs --latency (the calibration runs on cpu/default)")
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="bench_async_"))
    model = build_tiny_qwen2(tmp / "model")
    steps = {"default": 30 if args.quick else None, "long_tail": 10 if args.quick else 60}
    if args.steps is not None:
        steps = dict.fromkeys(TASKS, args.steps)
    tables: dict[str, dict[str, dict[str, Any]]] = {}
    latency = args.latency
    if args.smoke:
        steps, latency = {"default": 2, "long_tail": 2}, latency or 0.001
    for engine, task in pairs(args.only, args.smoke):
        base = [*common(tmp, model), *task_overrides(task, tmp, steps[task])]
        base += SMOKE if args.smoke else []
        if engine == "emulated" and latency is None:
            latency = calibrate(tables["cpu/default"]["sync"], max_tokens=4)
            print(f"emulated latency: {latency * 1000:.1f} ms per engine step", flush=True)
        print(f"## {engine} / {task}", flush=True)
        step_latency = 0.0 if engine == "cpu" else latency
        names = ["sync", HEADLINE] if args.smoke and task == "long_tail" else [*VARIANTS]
        tables[f"{engine}/{task}"] = run_variants(base, step_latency, names)
    sweep = [] if args.smoke or args.only else run_sweep(tmp, model, latency)
    shutdown_local_engines()
    ratios = compute_ratios(tables)
    if not args.smoke:
        name = "async_" + args.only.replace("/", "_") if args.only else None
        out, default_latency = results_dir(args), args.latency is None
        _write(out, tables, ratios, sweep, latency, args.quick, name, default_latency)
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}")
    headline = args.only or "emulated/default"
    print(f"fully_async_vs_sync_{headline.split('/')[0]}: {ratios[f'{headline}/{HEADLINE}']:.2f}")
    return 0


ENGINES, TASKS = ("cpu", "emulated"), ("default", "long_tail")


def pairs(only: str | None, smoke: bool) -> list[tuple[str, str]]:
    """(engine, task) runs in order: the cpu ones first (they calibrate the latency)."""
    if only:
        engine, task = only.split("/")
        return [(engine, task)]
    return [(e, t) for e in (("emulated",) if smoke else ENGINES) for t in TASKS]


def common(tmp: Path, model: Path) -> list[str]:
    return [
        f"output_dir={tmp / 'out'}",
        f"model_path={model}",
        "train_worker.save_freq=0",
        "logger.backend=[jsonl]",
    ]


def calibrate(sync_cpu: dict[str, Any], max_tokens: int) -> float:
    """Latency per engine step that makes one batch generate in about one train step."""
    return sync_cpu["train_s"] / (1 + max_tokens)


SWEPT = (HEADLINE, "fully-async(1)+abort")


def run_sweep(tmp: Path, model: Path, latency: float) -> list[dict[str, Any]]:
    """sync vs the fully-async variants at half and double the calibrated latency (30 steps)."""
    base = [*common(tmp, model), *task_overrides("default", tmp, 30)]
    rows = []
    for scale in (0.5, 2.0):
        res = run_variants(base, latency * scale, ["sync", *SWEPT])
        sync = res["sync"]["samples_per_s"]
        ratios = {name: res[name]["samples_per_s"] / sync for name in SWEPT}
        rows.append({"scale": scale, "latency_s": latency * scale, "ratios": ratios})
    return rows


def compute_ratios(tables: dict[str, dict[str, dict[str, Any]]]) -> dict[str, float]:
    out = {}
    for key, results in tables.items():
        sync = results["sync"]["samples_per_s"]
        for name in [n for n in VARIANTS if n in results and n != "sync"]:
            out[f"{key}/{name}"] = results[name]["samples_per_s"] / sync
    return out


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _row(engine: str, task: str, name: str, r: dict[str, Any]) -> str:
    return (
        f"| {engine} | {task} | {name} | {r['samples_per_s']:.0f} | "
        f"{_fmt(r['steps_to_target'], 'd')} | {_fmt(r['train_s_to_target'], '.0f')} | "
        f"{r['wall_s']:.0f} | {r['val_reward']:.3f} | {r['staleness_max']} | "
        f"{r['staleness_mean']:.2f} | {r['aborts']} | {r['continuations']} | {r['stale_drops']} |"
    )


def _write(
    out: Path,
    tables,
    ratios,
    sweep,
    latency: float,
    quick: bool,
    name: str | None = None,
    calibrated: bool = True,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    name = name or ("async_quick" if quick else "async")
    title = {"async": "full", "async_quick": "--quick"}.get(name, name)
    payload = {
        **record(),
        "tables": tables,
        "ratios": ratios,
        "sweep": sweep,
        "latency_s": latency,
    }
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1))
    header = (
        "| engine | task | variant | samples/s | steps to 0.9 | train-s to 0.9 | wall s "
        "| final val | stale max | stale mean | aborts | continuations | stale drops |\n|"
        + "---|"
        * 13
    )
    rows = [
        _row(*key.split("/"), variant, r)
        for key, results in tables.items()
        for variant, r in results.items()
    ]
    lines = [
        f"# bench_async ({title})",
        "",
        describe(),
        f"Load average at the end: {_load()}. Emulated latency: {latency * 1000:.1f} ms "
        "per engine step ("
        + ("calibrated: one batch generates in about one train step" if calibrated else "given")
        + ").",
        "",
        header,
        *rows,
        "",
        "samples/s relative to sync:",
        "",
        *(f"- {k}: {v:.2f}" for k, v in ratios.items()),
        "",
    ]
    if sweep:
        lines += [
            "Latency sweep (default task, 30 steps, samples/s vs sync):",
            "",
            *(
                f"- {s['scale']}x ({s['latency_s'] * 1000:.1f} ms): "
                + ", ".join(f"{k} {v:.2f}" for k, v in s["ratios"].items())
                for s in sweep
            ),
            "",
        ]
    (out / f"{name}.md").write_text("\n".join(lines))


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


if __name__ == "__main__":
    raise SystemExit(main())
