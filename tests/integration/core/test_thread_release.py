"""A run's threads let their OpenMP workers exit when they go idle (docs/training.md,
"Threads for a small model"): the controller's thread once the models are loaded, the
train worker after each step. The engine's own release is in tests/unit/models."""

from __future__ import annotations

import threading

import torch

from nexrl import controller as controller_module
from nexrl.controller import NexRLController
from nexrl.training import train_worker as train_worker_module


def test_a_sync_run_releases_the_loading_threads_team_and_the_trainers_after_each_step(
    small_config, monkeypatch
):
    calls: list[str] = []
    for module in (controller_module, train_worker_module):
        real = module.release_workers

        def record(real=real) -> None:
            calls.append(threading.current_thread().name)
            real()

        monkeypatch.setattr(module, "release_workers", record)
    controller = NexRLController(small_config("train_worker.engine.threads=null"))
    (worker,) = controller.system.train_workers
    assert worker._client.engine_config.threads == torch.get_num_threads()  # sync: all
    controller.run()
    assert calls[0] == threading.main_thread().name  # before the first step
    assert calls[1:] == ["train-worker"] * 3  # one per step
