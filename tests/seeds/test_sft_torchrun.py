"""SFT under torchrun (seed 004's SFT launch): two CPU ranks (gloo) train the same
steps as one process; each rank draws the same pairs, so the averaged gradient is the
single process's and the saved weights must match."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from nexrl.training.checkpoint import read_hf_weights
from nexrl.training.sft import run_sft


@pytest.mark.slow
def test_two_torchrun_ranks_train_like_one_process(tiny_model_path, tmp_path):
    args = ["--model-path", tiny_model_path, "--steps", "3", "--batch-size", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    out = subprocess.run(
        [*torchrun, "-m", "nexrl.training.sft", *args, "--output", str(tmp_path / "dp")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    ranks = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert len(ranks) == 2 and {r["steps"] for r in ranks} == {3.0}
    single = run_sft(tiny_model_path, str(tmp_path / "one"), 3, 4, {"lr": 1e-3})
    assert single["loss"] == pytest.approx(ranks[0]["loss"], rel=1e-4)
    dp, one = read_hf_weights(tmp_path / "dp"), read_hf_weights(tmp_path / "one")
    assert dp.keys() == one.keys()
    for name in one:
        assert torch.allclose(dp[name], one[name], atol=1e-5), name
