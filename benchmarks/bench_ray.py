"""Ray mode vs local mode on the default run: start-up and per-step cost apart, one script.

Both runs use the default config (`nexrl train`), shortened to `--steps` train steps
with the same seed; local first, then Ray (`ray.init` with the local CPUs). Per mode:

- start-up: building the controller (Ray: starting the actors and building the modules);
- run: `run()` to its end (the step-0 validation, the steps, the final validation);
- steps: the sum of the train worker's `timing/step_s` (`metrics.jsonl`), i.e. the run
  without start-up and without the step-0 validation; its median and mean per step.

Ray mode also reports the Ray calls every process made through `execute`, per train
step and by `module.method` (`nexrl.execute.REMOTE_CALLS`, summed over the driver and
the module actors).

    python benchmarks/bench_ray.py [--steps 20] [--rounds 1] [--out DIR | --update-results]
        [--layouts one_actor rollout_train]   # Ray runs per layout (default: ray.layout's)
    python benchmarks/bench_ray.py --smoke   # 2 tiny steps per mode, nothing written

Last lines: `ray_vs_local_step_median: X` (the headline: Ray's median seconds per step
over local's; 1.0 = no per-step overhead), `ray_vs_local_wallclock: X` (whole runs);
each the median over rounds of the round's Ray/local ratio. A layout other than the
default is reported as `ray_<layout>_vs_local_*`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from _machine import add_out_arguments, command, machine, results_dir

from nexrl.config import load_config
from nexrl.config.schema import RayConfig
from nexrl.controller import NexRLController
from nexrl.execute import REMOTE_CALLS

SMOKE = [
    "trajectory_pool.batch_size=8",
    "rollout_worker.group_size=4",
    "weight.validate_freq=0",
    "validate.validate_before_train=false",
    "train_worker.save_freq=0",
]


def step_timings(run_dir: str | Path) -> dict[str, list[float]]:
    """`timing/{step,train,wait}_s` of every train step in `<run_dir>/metrics.jsonl`."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").open()]
    rows = sorted((r for r in rows if "timing/step_s" in r), key=lambda r: r["step"])
    return {k: [r[f"timing/{k}"] for r in rows] for k in ("step_s", "train_s", "wait_s")}


def ray_calls(controller: NexRLController) -> dict[str, int]:
    """Ray calls made through `execute` by the driver and every module actor."""
    import ray

    actors = controller.system.resource_manager.actors.values()
    total = Counter(REMOTE_CALLS)
    for counts in ray.get([a.call_counts.remote() for a in actors]):
        total.update(counts)
    return dict(total)


def one_run(mode: str, steps: int, out: str, extra: list[str]) -> dict[str, Any]:
    """`mode`: `local`, `ray` (the default layout) or `ray_<layout>` (`ray.layout`)."""
    launch, _, layout = mode.partition("_")
    cfg = load_config(
        [
            f"launch_mode={launch}",
            f"train_worker.total_train_steps={steps}",
            f"output_dir={out}/{mode}",
            "logger.backend=[jsonl]",
            *([f"ray.layout={layout}"] if layout else []),
            *extra,
        ]
    )
    REMOTE_CALLS.clear()
    t0 = time.perf_counter()
    controller = NexRLController(cfg)
    t1 = time.perf_counter()
    final = controller.run()
    t2 = time.perf_counter()
    timings = step_timings(controller.run_dir)
    per_step = timings["step_s"]
    result: dict[str, Any] = {
        "total_s": t2 - t0,
        "startup_s": t1 - t0,
        "run_s": t2 - t1,
        "steps_s": sum(per_step),
        "step_median_s": statistics.median(per_step),
        "step_mean_s": statistics.fmean(per_step),
        "train_median_s": statistics.median(timings["train_s"]),
        "wait_median_s": statistics.median(timings["wait_s"]),
        "step_s": [round(t, 4) for t in per_step],
        "load_average_1m": os.getloadavg()[0],
        **final,
    }
    if launch == "ray":
        calls = ray_calls(controller)
        result["ray_calls_per_step"] = {
            k: round(v / len(per_step), 2) for k, v in sorted(calls.items(), key=lambda x: -x[1])
        }
        controller.system.shutdown()
    return result


def print_run(mode: str, r: dict[str, Any]) -> None:
    print(
        f"{mode:5s} total {r['total_s']:.1f} s (start-up {r['startup_s']:.1f} s, "
        f"run {r['run_s']:.1f} s, steps {r['steps_s']:.1f} s), per step median "
        f"{r['step_median_s']:.3f} s mean {r['step_mean_s']:.3f} s (median train "
        f"{r['train_median_s']:.3f} s, wait {r['wait_median_s']:.3f} s), "
        f"final val/reward {r.get('val/reward', 0):.3f}, load {r['load_average_1m']:.1f}",
        flush=True,
    )
    if "ray_calls_per_step" in r:
        calls = r["ray_calls_per_step"]
        top = ", ".join(f"{k} {v:g}" for k, v in list(calls.items())[:12])
        print(f"      Ray calls per step: {sum(calls.values()):.1f} ({top})", flush=True)


def ratio(results: dict[str, list[dict[str, Any]]], key: str, mode: str = "ray") -> float:
    """`mode` over local per round (the runs of a round ran back to back), the median over
    rounds: the machine's load moves between rounds more than between the runs of one."""
    pairs = zip(results[mode], results["local"], strict=True)
    return statistics.median(ray[key] / local[key] for ray, local in pairs)


def headline(results: dict[str, list[dict[str, Any]]], mode: str) -> dict[str, float]:
    keys = {"step_median": "step_median_s", "step_mean": "step_mean_s", "steps_only": "steps_s"}
    keys |= {"run_only": "run_s", "startup": "startup_s", "wallclock": "total_s"}
    return {f"{mode}_vs_local_{name}": ratio(results, key, mode) for name, key in keys.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1, help="local/ray pairs, interleaved")
    add_out_arguments(parser)
    parser.add_argument("--smoke", action="store_true", help="2 tiny steps per mode, no files")
    parser.add_argument(
        "--layouts", nargs="+", default=None, help="ray.layout of each Ray run (default: its own)"
    )
    args = parser.parse_args(argv)
    import ray

    if args.smoke:
        args.steps, args.rounds = 2, 1

    os.environ.setdefault("NEXRL_HOME", tempfile.mkdtemp(prefix="nexrl_bench_"))
    default = RayConfig.layout
    rays = [f"ray_{x}" if x != default else "ray" for x in args.layouts or [default]]
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in ["local", *rays]}
    with tempfile.TemporaryDirectory() as out:
        for _ in range(args.rounds):
            for mode in results:
                results[mode].append(one_run(mode, args.steps, out, SMOKE if args.smoke else []))
                print_run(mode, results[mode][-1])
                if ray.is_initialized():
                    ray.shutdown()  # each Ray run starts its own Ray
    ratios = {k: v for mode in rays for k, v in headline(results, mode).items()}
    if not args.smoke:
        payload = {
            "machine": machine(),
            "command": command(),
            "load_average": os.getloadavg(),
            "steps": args.steps,
            **ratios,
            **results,
        }
        out = results_dir(args)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ray.json").write_text(json.dumps(payload, indent=1))
    for key, value in ratios.items():
        print(f"{key}: {value:.3f}")


if __name__ == "__main__":
    main()
