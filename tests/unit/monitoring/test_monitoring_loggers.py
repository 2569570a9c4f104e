"""ExperimentLogger: jsonl lines with step, backend selection, console line, lazy backends."""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch

from nexrl.monitoring import ExperimentLogger
from nexrl.monitoring.loggers import ConsoleBackend, parse_backends


def test_jsonl_writes_one_valid_object_per_line_with_step(tmp_path) -> None:
    log = ExperimentLogger(backends="console", run_dir=tmp_path, total_steps=10)
    log.post("metrics", data={"reward": torch.tensor(0.25), "hist": torch.tensor([1, 2])}, step=1)
    path = tmp_path / "metrics.jsonl"
    assert path.read_text().count("\n") == 1  # flushed per line, before close
    log.post("metrics", data={"val/reward": 0.5})  # no step: the last one seen
    log.post("metrics", data={})  # nothing to log
    log.post("jsonl", data={"loss": 1.5}, step=2)
    log.post("wandb", data={"dropped": 1}, step=3)  # known backend, not enabled
    log.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    times = [row.pop("time") for row in rows]  # when each was logged, in order
    assert times == sorted(times) and abs(times[-1] - time.time()) < 60
    assert rows == [
        {"step": 1, "reward": 0.25, "hist": [1, 2]},
        {"step": 1, "val/reward": 0.5},
        {"step": 2, "loss": 1.5},
    ]
    with pytest.raises(ValueError, match="unknown backend"):
        ExperimentLogger().post("slack", data={"a": 1})


def test_backend_parsing_and_validation(tmp_path) -> None:
    assert parse_backends("console, jsonl") == ["console", "jsonl"]
    assert parse_backends(["console", "console"]) == ["console"]
    assert parse_backends(None) == []
    with pytest.raises(
        ValueError, match="valid choices: jsonl, console, tensorboard, wandb, mlflow"
    ):
        parse_backends("neptune")
    with pytest.raises(ValueError, match="run directory"):
        ExperimentLogger(backends="jsonl")
    assert list(ExperimentLogger(run_dir=tmp_path).backends) == ["jsonl"]  # always on


def test_console_line_has_step_reward_rate_and_eta() -> None:
    console = ConsoleBackend(live=False)
    console.total_steps = 10
    first = console.format_line({"reward/mean": 0.123456}, step=0, now=100.0)
    assert first == "step 0/10 | reward/mean 0.1235"
    line = console.format_line({"reward/mean": 0.5, "val/reward": 0.75}, step=4, now=108.0)
    assert line == "step 4/10 | reward/mean 0.5 | val/reward 0.75 | 2.00 s/step | ETA 0m12s"


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_missing_optional_backend_fails_with_install_hint(tmp_path, monkeypatch, name) -> None:
    monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    monkeypatch.setitem(sys.modules, f"{name}.tracking", None)
    with pytest.raises(ImportError, match=f"pip install 'nexrl\\[{name}\\]'"):
        ExperimentLogger(backends=name, run_dir=tmp_path)
