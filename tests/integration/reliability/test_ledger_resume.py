"""The end-of-run task ledger covers the whole run after `resume.mode=auto`: its counts
travel in the checkpoint (nexrl/monitoring/ledger.py). A real local run of the built-in
task, stopped after N steps and resumed to 2N."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from nexrl.cli import run_training
from nexrl.config import load_config
from nexrl.monitoring import ActivityTracker
from nexrl.monitoring.ledger import checkpoint_ledger, restore_ledger
from nexrl.monitoring.progress import task_summary
from nexrl.training.train_worker import STATE_FILE

COUNTS = re.compile(r"(\d+) (handed|trained|failed|dropped|not)")


def ledger_line(out: str) -> dict[str, int]:
    line = next(x for x in out.splitlines() if x.startswith("nexrl: tasks: "))
    return {word: int(n) for n, word in COUNTS.findall(line)}


def overrides(tmp_path: Path, model: str, steps: int) -> list[str]:
    return [
        f"output_dir={tmp_path / 'out'}",
        f"model_path={model}",
        "rollout_worker.group_size=4",
        "rollout_worker.max_tokens=4",
        "rollout_worker.num_workers=2",
        "trajectory_pool.batch_size=8",  # 2 tasks a step
        f"train_worker.total_train_steps={steps}",
        "train_worker.save_freq=2",
        "validate.validate_before_train=false",
        "logger.backend=[jsonl]",
    ]


@pytest.mark.slow
def test_the_ledger_after_a_resume_covers_both_parts(tmp_path, tiny_model_path, capsys):
    assert run_training(load_config(overrides(tmp_path, tiny_model_path, 2))) == 0
    first = ledger_line(capsys.readouterr().out)
    assert first["trained"] == 4  # 2 steps x 2 tasks
    saved = next((tmp_path / "out").rglob("global_step_2"))
    state = json.loads((saved / STATE_FILE).read_text())
    assert state["ledger"]["tasks_trained"] == 4

    again = overrides(tmp_path, tiny_model_path, 4) + ["resume.mode=auto"]
    assert run_training(load_config(again)) == 0
    whole = ledger_line(capsys.readouterr().out)
    assert whole["trained"] == 8 and whole["failed"] == 0  # 4 steps x 2 tasks, both parts
    assert whole["handed"] == whole["trained"] + whole["dropped"] + whole["not"]
    assert whole["handed"] >= 8


def test_a_checkpoint_keeps_the_settled_counts_and_restores_them():
    counters = {
        "tasks_in/train": 12,  # 3 of them not finished at the save: handed out again later
        "tasks_trained": 6,
        "tasks_failed/train": 1,
        "groups_dropped/stale": 2,
        "rollout/released/fail": 3,
        "tasks_in/validate": 8,
    }
    kept = checkpoint_ledger(counters)
    assert kept == {
        "tasks_in/train": 9,
        "tasks_trained": 6,
        "tasks_failed/train": 1,
        "groups_dropped/stale": 2,
        "rollout/released/fail": 3,
    }

    tracker = ActivityTracker({})
    assert restore_ledger(tracker, kept) == kept
    tracker.increment("tasks_in/train", 3)  # the resumed run hands the 3 out again
    tracker.increment("tasks_trained", 3)  # and trains them
    assert task_summary(tracker.get_counters()).startswith(
        "tasks: 12 handed out; 9 trained, 1 failed, 2 dropped (stale 2), 0 not finished"
    )
    assert restore_ledger(tracker, None) == {}  # a checkpoint from before ledgers were kept
