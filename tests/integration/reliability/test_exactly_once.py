"""Exactly once: every item of an epoch is trained once across SIGKILLs and resumes.

A fully-async run (staleness 2, so two batches of tasks are generating or
pooled at every checkpoint) over a finite dataset (`data.num_epochs=1`) is
killed with SIGKILL again and again, at a random moment, while a checkpoint is
being written, or while the weights for a push are being written, and resumed
with `resume.mode=auto` until it finishes. `train_worker.log_trained_uids`
writes each step's data uids before that step's checkpoint.

Reconstruction: the steps a run segment trained after the checkpoint the next
segment resumed from are discarded (the resumed run trains them again), so
segment k counts the steps in (resume_k, resume_{k+1}]. Those steps must be
1..N exactly once, and their uids the dataset exactly once.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

import nexrl

pytestmark = pytest.mark.slow

REPO = Path(nexrl.__file__).resolve().parents[1]
ITEMS = 128  # 32 steps of 4 groups
KILLS = 6
RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")
STEP_LINE = re.compile(r"^step (\d+)/", flags=re.M)
KINDS = ("random", "save", "push")


def _start(out: Path, log: Path) -> subprocess.Popen:
    args = [
        "train",
        f"output_dir={out}",
        "resume.mode=auto",
        f"data.max_items={ITEMS}",
        "data.num_epochs=1",
        "train_worker.save_freq=1",
        "train_worker.log_trained_uids=true",
        "rollout_worker.group_size=4",
        "rollout_worker.num_workers=2",
        "trajectory_pool.batch_size=16",
        "weight.sync_mode=fully-async",
        "weight.staleness_threshold=2",
        "weight.tail_batch_candidate_steps=1",
        "weight.transport=file",  # the push kills wait for the export's staging folder
        "weight.validate_freq=0",
        "validate.validate_before_train=false",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "nexrl.cli", *args],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,  # its own process group: the kill takes every child too
    )


def _run_dir(out: Path) -> Path | None:
    runs = sorted((out / "shift_letters").glob("*/config.yaml"))
    return runs[0].parent if runs else None


def _latest_step(log: Path) -> int:
    steps = STEP_LINE.findall(log.read_text())
    return int(steps[-1]) if steps else 0


def _staging(folder: Path) -> bool:
    return folder.is_dir() and any(".staging-" in name for name in os.listdir(folder))


def _kill(proc: subprocess.Popen, log: Path, out: Path, kind: str, target: int, jitter: float):
    """SIGKILL the group once step `target` is logged, then: at once plus `jitter` s
    (random), when a checkpoint staging folder appears (save), or when the weight-sync
    export staging folder appears (push). Returns whether that kind's folder was there."""
    end = time.monotonic() + 120
    while time.monotonic() < end and proc.poll() is None and _latest_step(log) < target:
        time.sleep(0.01)
    run = _run_dir(out)
    watch = {"save": run / "checkpoints", "push": run}.get(kind) if run else None
    if watch is None:
        time.sleep(jitter)
    else:
        while time.monotonic() < end and proc.poll() is None and not _staging(watch):
            time.sleep(0.0005)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return watch is not None and _staging(watch)


def test_each_item_trained_exactly_once_across_sigkills(tmp_path, started_runs):
    _kill_and_resume(tmp_path, started_runs)


def _kill_and_resume(tmp_path: Path, started: list[subprocess.Popen]) -> None:
    rng = random.Random(int(os.environ.get("NEXRL_KILL_SEED", "15")))
    out = tmp_path / "out"
    figures = Counter()
    segments: list[tuple[int, int]] = []  # (resume step, first line of trained.jsonl)
    for attempt in range(KILLS + 1):
        log = tmp_path / f"attempt{attempt}.log"
        run = _run_dir(out)
        lines = len((run / "trained.jsonl").read_text().splitlines()) if run else 0
        proc = _start(out, log)
        started.append(proc)
        if attempt < KILLS:
            kind = KINDS[attempt % len(KINDS)]
            base = segments[-1][0] if segments else 0
            if attempt:  # kill only once the resume happened
                end = time.monotonic() + 300
                while "resumed from" not in log.read_text() and proc.poll() is None:
                    assert time.monotonic() < end, "no resume within 300 s"
                    time.sleep(0.05)
                base = int(RESUMED.search(log.read_text()).group(2))
            target = base + rng.randint(1, 4)
            figures[f"kill_{kind}_in_progress"] += _kill(
                proc, log, out, kind, target, rng.uniform(0.0, 0.3)
            )
            figures["kills"] += proc.returncode == -signal.SIGKILL
        else:
            try:
                figures["final_rc"] = proc.wait(timeout=300)
            except subprocess.TimeoutExpired:  # still report what was lost
                os.killpg(proc.pid, signal.SIGKILL)
                figures["final_rc"] = proc.wait()
        found = RESUMED.search(log.read_text())
        assert (found is not None) == (attempt > 0), log.read_text()[-3000:]
        segments.append((int(found.group(2)) if found else 0, lines))
        if proc.returncode == 0:  # finished before its kill: nothing left to resume
            break

    trained = _reconstruct(_run_dir(out) / "trained.jsonl", segments)
    counts = Counter(uid for uids in trained.values() for uid in uids)
    dataset = {f"0-{i}" for i in range(ITEMS)}
    lost = sorted(dataset - set(counts))
    duplicated = sorted(uid for uid, n in counts.items() if n > 1)
    figures.update(
        steps=len(trained), items=len(counts), lost=len(lost), duplicated=len(duplicated)
    )
    print("exactly-once figures:", dict(figures))
    assert not lost, f"{len(lost)} items never trained: {lost}"
    assert not duplicated, f"{len(duplicated)} items trained twice: {duplicated}"
    assert set(counts) == dataset
    assert figures["final_rc"] == 0, log.read_text()[-3000:]
    assert sorted(trained) == list(range(1, ITEMS // 4 + 1))
    assert figures["kills"] == KILLS  # no attempt ended on its own before its kill


def _reconstruct(path: Path, segments: list[tuple[int, int]]) -> dict[int, list[str]]:
    """step -> uids, keeping segment k's steps in (resume_k, resume_{k+1}]."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    trained: dict[int, list[str]] = {}
    for k, (resumed, first) in enumerate(segments):
        last = segments[k + 1][1] if k + 1 < len(segments) else len(rows)
        upto = segments[k + 1][0] if k + 1 < len(segments) else float("inf")
        for row in rows[first:last]:
            if resumed < row["step"] <= upto:
                assert row["step"] not in trained, f"step {row['step']} counted twice"
                trained[row["step"]] = row["uids"]
    return trained
