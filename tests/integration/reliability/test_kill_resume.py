"""SIGKILL `nexrl train` at random points, including mid-save; `resume.mode=auto` carries on.

Each attempt starts the real CLI in its own process group and kills the whole
group with SIGKILL, either at a random moment or the instant a checkpoint
staging folder appears (a save in progress). After every kill the next start
must resume from the newest checkpoint that was *complete* at the kill, in the
same run folder; the last start must finish. The counts are printed for
docs/reliability.md.
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
from pathlib import Path

import pytest

import nexrl
from nexrl.run_setup import checkpoint_problem

pytestmark = pytest.mark.slow

REPO = Path(nexrl.__file__).resolve().parents[1]
TOTAL_STEPS = 80
KILLS = 8
RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")
STEP_LINE = re.compile(r"^step (\d+)/", flags=re.M)


def _start(out: Path, log: Path) -> subprocess.Popen:
    args = [
        "train",
        f"output_dir={out}",
        "resume.mode=auto",
        f"train_worker.total_train_steps={TOTAL_STEPS}",
        "train_worker.save_freq=2",
        "rollout_worker.group_size=4",
        "rollout_worker.num_workers=2",
        "trajectory_pool.batch_size=16",
        "weight.validate_freq=0",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "nexrl.cli", *args],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,  # its own process group: the kill takes every child too
    )


def _checkpoint_dirs(out: Path) -> list[Path]:
    return sorted(out.glob("shift_letters/*/checkpoints/*"))


def _complete(out: Path) -> list[Path]:
    return [p for p in _checkpoint_dirs(out) if not p.name.startswith(".")]


def _newest_complete_step(out: Path) -> int | None:
    steps = [int(p.name.rsplit("_", 1)[1]) for p in _complete(out) if checkpoint_problem(p) is None]
    return max(steps) if steps else None


def _staging(out: Path) -> list[Path]:
    return [p for p in _checkpoint_dirs(out) if ".staging-" in p.name]


def _wait_until(proc: subprocess.Popen, ready, what: str, limit: float = 300) -> None:
    end = time.monotonic() + limit
    while not ready():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < end, f"no {what} within {limit} s"
        time.sleep(0.05)


def _latest_step(log: Path) -> int:
    steps = STEP_LINE.findall(log.read_text())
    return int(steps[-1]) if steps else 0


def _kill_when(
    proc: subprocess.Popen, log: Path, ckpt_dir: Path, mid_save: bool, target: int, jitter: float
) -> None:
    """SIGKILL the group as a staging folder appears (mid_save), else once step `target`
    is logged plus `jitter` seconds (a random moment inside a step: rollout, train, push,
    save)."""
    end = time.monotonic() + 120
    while time.monotonic() < end and proc.poll() is None:
        if mid_save and any(".staging-" in name for name in os.listdir(ckpt_dir)):
            break
        if not mid_save and _latest_step(log) >= target:
            time.sleep(jitter)
            break
        time.sleep(0.001 if mid_save else 0.01)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_sigkill_at_random_points_then_auto_resume_finishes(tmp_path, started_runs):
    _kill_and_resume(tmp_path, started_runs)


def _kill_and_resume(tmp_path: Path, started: list[subprocess.Popen]) -> None:
    rng = random.Random(int(os.environ.get("NEXRL_KILL_SEED", "15")))
    out = tmp_path / "out"
    figures = {"kills": 0, "mid_save": 0, "resumes": 0, "skipped_incomplete": 0}
    expected_step: int | None = None
    run_dir: Path | None = None
    for attempt in range(KILLS + 1):
        log = tmp_path / f"attempt{attempt}.log"
        proc = _start(out, log)
        started.append(proc)
        if attempt == 0:
            _wait_until(proc, lambda: _newest_complete_step(out), "a first checkpoint")
        elif attempt < KILLS:  # kill only once the resume happened and training goes on
            _wait_until(proc, lambda log=log: "resumed from" in log.read_text(), "the resume")
        if attempt < KILLS:
            mid_save = attempt % 2 == 1
            ckpt_dir = _complete(out)[0].parent
            base = expected_step if expected_step is not None else _latest_step(log)
            target = base + rng.randint(1, 6)
            _kill_when(proc, log, ckpt_dir, mid_save, target, rng.uniform(0.0, 0.3))
            figures["kills"] += proc.returncode == -signal.SIGKILL
            figures["mid_save"] += bool(_staging(out))
        else:
            assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
        text = log.read_text()
        if expected_step is not None:  # this start had a checkpoint to resume from
            found = RESUMED.search(text)
            assert found, text[-3000:]
            assert int(found.group(2)) == expected_step, text[-3000:]
            # complete at the kill (expected_step only counts complete ones), same folder
            assert Path(found.group(1)).parents[1] == run_dir
            figures["resumes"] += 1
            figures["skipped_incomplete"] += text.count("skipping checkpoint")
        expected_step = _newest_complete_step(out)
        run_dir = run_dir or _complete(out)[0].parents[1]

    print("kill/resume figures:", figures)
    runs = list((out / "shift_letters").iterdir())
    assert len(runs) == 1, runs  # every resume continued the same run folder
    steps = [json.loads(line).get("step") for line in (runs[0] / "metrics.jsonl").open()]
    assert TOTAL_STEPS in steps
    assert _newest_complete_step(out) == TOTAL_STEPS
    assert figures["kills"] == KILLS  # no attempt ended on its own before its kill
    assert figures["mid_save"] >= 1
