"""`python -m nexrl.training.service` as a real process, driven by the remote client."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
import torch

from nexrl.training.client import TrainServiceClient
from nexrl.training.parallel import free_port
from nexrl.training.synthetic import random_batch

PPO = {"clip_low": 0.2, "clip_high": 0.28}


@pytest.mark.slow
def test_service_process_matches_in_process_engine(tiny_model, tmp_path):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "nexrl.training.service",
        "--model-path",
        tiny_model,
        "--port",
        str(port),
        "lr=1e-3",
        "micro_batch_tokens=32",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "service did not start"
                time.sleep(0.3)
        engine_cfg = {"lr": 1e-3, "micro_batch_tokens": 32}
        remote = TrainServiceClient({"backend": "remote", "url": url}, engine_cfg, tiny_model)
        local = TrainServiceClient({"backend": "builtin"}, engine_cfg, tiny_model)
        remote.initialize()
        local.initialize()
        for seed in range(2):
            batch = random_batch(6, 12, seed=seed)
            batch.values["old_logprobs"] = remote.compute_logprobs(batch)
            assert remote.train_batch(batch, "ppo_clip", PPO) == local.train_batch(
                batch, "ppo_clip", PPO
            )
        w_r, w_l = remote.export_weights(), local.export_weights()
        assert all(torch.equal(w_r[k], w_l[k]) for k in w_l)
        remote.save_checkpoint(str(tmp_path / "ck"))
        assert (tmp_path / "ck" / "model.safetensors").exists() and remote.get_step() == 2
    finally:
        proc.terminate()
        proc.wait(timeout=30)
