"""Wall-clock of the default run in Ray mode vs local mode, same settings, one script.

Both runs use the default config (`nexrl train`), shortened to `--steps` train steps
with the same seed; local first, then Ray (`ray.init` with the local CPUs). The clock
runs from building the controller (Ray: starting the actors) to the end of `run()`;
the run time alone (without start-up) is printed too.

    python benchmarks/bench_ray.py [--steps 20] [--rounds 1] [--out benchmarks/results/ray.json]
    python benchmarks/bench_ray.py --smoke   # 2 tiny steps per mode, nothing written

Last line: `ray_vs_local_wallclock: X` (Ray seconds / local seconds; 1.0 = no overhead).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from _machine import command, machine

from nexrl.config import load_config
from nexrl.controller import NexRLController

SMOKE = [
    "trajectory_pool.batch_size=8",
    "rollout_worker.group_size=4",
    "weight.validate_freq=0",
    "validate.validate_before_train=false",
    "train_worker.save_freq=0",
]


def one_run(mode: str, steps: int, out: str, extra: list[str]) -> dict[str, float]:
    cfg = load_config(
        [
            f"launch_mode={mode}",
            f"train_worker.total_train_steps={steps}",
            f"output_dir={out}",
            "logger.backend=[jsonl]",
            *extra,
        ]
    )
    t0 = time.perf_counter()
    controller = NexRLController(cfg)
    t1 = time.perf_counter()
    final = controller.run()
    t2 = time.perf_counter()
    if mode == "ray":
        controller.system.shutdown()
    return {"total_s": t2 - t0, "startup_s": t1 - t0, "run_s": t2 - t1, **final}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1, help="local/ray pairs, interleaved")
    parser.add_argument("--out", default=None, help="write the numbers as JSON here")
    parser.add_argument("--smoke", action="store_true", help="2 tiny steps per mode, no files")
    args = parser.parse_args(argv)
    import ray

    if args.smoke:
        args.steps, args.rounds, args.out = 2, 1, None

    os.environ.setdefault("NEXRL_HOME", tempfile.mkdtemp(prefix="nexrl_bench_"))
    results: dict[str, list[dict[str, float]]] = {"local": [], "ray": []}
    with tempfile.TemporaryDirectory() as out:
        for _ in range(args.rounds):
            for mode in ("local", "ray"):
                results[mode].append(one_run(mode, args.steps, out, SMOKE if args.smoke else []))
                r = results[mode][-1]
                print(
                    f"{mode:5s} total {r['total_s']:.1f} s (start-up {r['startup_s']:.1f} s, "
                    f"run {r['run_s']:.1f} s), final val/reward {r.get('val/reward', 0):.3f}",
                    flush=True,
                )
    if ray.is_initialized():
        ray.shutdown()
    local = sum(r["total_s"] for r in results["local"])
    remote = sum(r["total_s"] for r in results["ray"])
    run_ratio = sum(r["run_s"] for r in results["ray"]) / sum(r["run_s"] for r in results["local"])
    if args.out:
        payload = {"machine": machine(), "command": command(), "steps": args.steps, **results}
        Path(args.out).write_text(json.dumps(payload, indent=1))
    print(f"ray_vs_local_run_only: {run_ratio:.3f}")
    print(f"ray_vs_local_wallclock: {remote / local:.3f}")


if __name__ == "__main__":
    main()
