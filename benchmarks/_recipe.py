"""Seconds per step of a training recipe on each inference backend, one after the other in
one run (`bench_generation.py --recipe-steps N`).

Each backend runs `python -m nexrl.cli train --config-name RECIPE
service.inference_service.backend=B train_worker.total_train_steps=N` in a child process
of this interpreter (so both backends share one environment: a vLLM venv runs the
built-in engine too). From the run's `metrics.jsonl`: the held-out greedy accuracy at each
validation (`val/reward`), `timing/step_s` of every step; and wall time from launch to
exit (start-up, vLLM's included), peak resident memory of the run's whole process tree
(sampled every 0.5 s: the trainer plus vLLM's API server, engine core and workers), and
the largest single process's peak (`ru_maxrss`, what `/usr/bin/time -v` reports).

`--smoke`: the default tiny model and task, 2 small steps per backend, no files written.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _machine import describe, prepend_section, record, section_head

SMOKE_OVERRIDES = (
    "rollout_worker.num_workers=2",
    "rollout_worker.group_size=4",
    "rollout_worker.max_tokens=8",
    "trajectory_pool.batch_size=8",
    "weight.validate_freq=2",
    "validate.data.max_items=8",
    "+service.inference_service.engine.max_model_len=128",
)
SAMPLE_S = 0.5


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants (0 once it is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            continue
    return total


def train_command(recipe: str | None, backend: str, steps: int, out: Path, smoke: bool) -> list:
    cmd = [sys.executable, "-m", "nexrl.cli", "train"]
    cmd += ["--config-name", recipe] if recipe else []
    cmd += [f"service.inference_service.backend={backend}", f"output_dir={out}"]
    cmd += [f"train_worker.total_train_steps={steps}", "train_worker.save_freq=0"]
    cmd += ["logger.backend=[jsonl]"]
    return cmd + list(SMOKE_OVERRIDES if smoke else ())


def run_backend(recipe: str | None, backend: str, steps: int, root: Path, smoke: bool) -> dict:
    """One training run on `backend`: its validation curve, timings and memory."""
    out = root / backend
    log = root / f"{backend}.log"
    cmd = train_command(recipe, backend, steps, out, smoke)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    peak = 0
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
        while proc.poll() is None:
            peak = max(peak, tree_rss(proc.pid))
            time.sleep(SAMPLE_S)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(
            f"{backend}: `{' '.join(cmd)}` exited {proc.returncode} (logs in {root}):\n{tail}"
        )
    metrics = [json.loads(x) for x in next(out.rglob("metrics.jsonl")).read_text().splitlines()]
    step_s = [m["timing/step_s"] for m in metrics if "timing/step_s" in m]
    val = {m["step"]: m["val/reward"] for m in metrics if "val/reward" in m}
    absdiff = [
        m["train/behavior_old_logprob_absdiff"]
        for m in metrics
        if "train/behavior_old_logprob_absdiff" in m
    ]

    def mean(key: str) -> float:
        return statistics.mean([m[key] for m in metrics if key in m] or [0.0])

    return {
        "backend": backend,
        "wait_s": mean("timing/wait_s"),  # for a batch of rollouts
        "update_s": mean("timing/update_s"),  # the trainer's update
        "push_s": mean("timing/export_s") + mean("timing/push_s"),
        "steps": len(step_s),
        "val": val,
        "step_s": step_s,
        "s_per_step": statistics.mean(step_s),
        "wall_s": wall,
        "peak_tree_rss_gib": peak / 2**30,
        "reward_mean": [m["reward/mean"] for m in metrics if "reward/mean" in m],
        "logprob_absdiff": absdiff,
    }


def peak_child_rss_gib() -> float:
    """The largest `ru_maxrss` among waited-for children (kB on Linux)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20


def row(r: dict[str, Any]) -> str:
    val = ", ".join(f"{s}: {v:.3f}" for s, v in sorted(r["val"].items()))
    steps = " ".join(f"{s:.0f}" for s in r["step_s"])
    gap = max(r["logprob_absdiff"], default=0.0)
    return (
        f"| {r['backend']} | {val} | {r['s_per_step']:.1f} ({steps}) "
        f"| {r['wait_s']:.1f} / {r['update_s']:.1f} | {r['wall_s']:.0f} "
        f"| {r['peak_tree_rss_gib']:.2f} | {gap:.1e} |"
    )


def write(out: Path, rows: list[dict], meta: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "generation_recipe.json").write_text(
        json.dumps({**record(), **meta, "runs": rows}, indent=2) + "\n"
    )
    lines = [
        *section_head(f", {meta['recipe']}, {meta['steps']} steps per backend"),
        f"Load average before / after: {meta['load_before']} / {meta['load_after']}.",
        "",
        "| backend | held-out accuracy by step | s/step mean (each step) "
        "| wait / update s a step | wall s | peak RSS GiB (process tree) | max logprob gap |",
        "|---|---|---|---|---|---|---|",
        *map(row, rows),
        "",
        f"Largest single process's peak RSS (`ru_maxrss`): {meta['max_child_rss_gib']:.2f} GiB.",
        "Wall time includes start-up (vLLM's server start) and the validations.",
        "",
    ]
    prepend_section(out / "generation_recipe.md", "# A recipe's steps on each backend", lines)


def recipe_run(recipe: str, steps: int, backends: list[str], out: Path | None, smoke: bool) -> int:
    """Run the recipe on each backend in turn; print one line per backend and the ratio."""
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    rows = []
    tmp = tempfile.mkdtemp(prefix="nexrl-recipe-")  # kept when a run fails: its logs
    for backend in backends:
        r = run_backend(None if smoke else recipe, backend, steps, Path(tmp), smoke)
        rows.append(r)
        val = " ".join(f"{s}:{v:.3f}" for s, v in sorted(r["val"].items()))
        print(
            f"recipe {backend:8s} {r['s_per_step']:7.1f} s/step  wall {r['wall_s']:6.0f} s  "
            f"peak {r['peak_tree_rss_gib']:.2f} GiB  val {val}",
            flush=True,
        )
    shutil.rmtree(tmp)
    meta = {
        "recipe": "default (smoke)" if smoke else recipe,
        "steps": steps,
        "load_before": load_before,
        "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "max_child_rss_gib": peak_child_rss_gib(),
    }
    print(describe().splitlines()[0])
    if not smoke and out is not None:
        write(out, rows, meta)
    by = {r["backend"]: r["s_per_step"] for r in rows}
    if "vllm" in by and "builtin" in by:
        print(f"recipe_vllm_vs_builtin_s_per_step: {by['vllm'] / by['builtin']:.2f}")
    prefix = "smoke: " if smoke else ""
    print(f"{prefix}recipe_steps_done: {' '.join(str(r['steps']) for r in rows)}")
    return 0
