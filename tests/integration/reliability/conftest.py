"""Fixtures for the fault-injection tests."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator

import pytest

from nexrl.models.tiny import build_tiny_qwen2


@pytest.fixture(scope="session")
def other_weights_path(tmp_path_factory) -> str:
    """Same architecture as the tiny model, other random weights (seed 1)."""
    return str(build_tiny_qwen2(tmp_path_factory.mktemp("models") / "tiny_seed1", seed=1))


@pytest.fixture
def started_runs() -> Iterator[list[subprocess.Popen]]:
    """Training subprocesses a kill test starts (each in its own process group); any still
    running at teardown is killed, so a failed assertion leaves no run behind."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
