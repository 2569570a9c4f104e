from __future__ import annotations

import pytest

from nexrl.config import load_config


@pytest.fixture
def small_overrides(tmp_path, tiny_model_path):
    """A few-second local run on the built-in task."""
    return [
        f"output_dir={tmp_path / 'out'}",
        f"model_path={tiny_model_path}",
        "rollout_worker.group_size=4",
        "rollout_worker.max_tokens=4",
        "rollout_worker.num_workers=2",
        "trajectory_pool.batch_size=16",
        "train_worker.total_train_steps=3",
        "train_worker.save_freq=2",
        "weight.validate_freq=2",
        "validate.data.max_items=8",
        "logger.backend=[jsonl]",
    ]


@pytest.fixture
def small_config(small_overrides):
    def make(*extra: str):
        return load_config([*small_overrides, *extra])

    return make


def spawn(cmd: list[str], url: str, timeout: float = 120.0):
    """Start a server process and wait until its /health answers 200."""
    import subprocess
    import time

    import httpx

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd} exited: {proc.stdout.read().decode()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{cmd} did not answer /health in {timeout}s")
        time.sleep(0.3)
