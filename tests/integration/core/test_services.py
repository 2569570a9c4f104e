"""The same run with inference and training as separate HTTP services (config switches)."""

import json
import sys
from pathlib import Path

import pytest

from nexrl.controller import NexRLController
from nexrl.training.parallel import free_port
from tests.servers import spawn


@pytest.mark.slow
def test_run_against_nexrl_serve_and_train_service_processes(small_config, tiny_model_path):
    serve_port, train_port = free_port(), free_port()
    serve_url, train_url = f"http://127.0.0.1:{serve_port}", f"http://127.0.0.1:{train_port}"
    nexrl = [sys.executable, "-m", "nexrl.cli"]
    procs = [
        spawn([*nexrl, "serve", "--model", tiny_model_path, "--port", str(serve_port)], serve_url),
        spawn(
            [
                *nexrl,
                "train-service",
                "--model-path",
                tiny_model_path,
                "--port",
                str(train_port),
                "lr=3e-4",
            ],
            train_url,
        ),
    ]
    try:
        cfg = small_config(
            "service.inference_service.backend=remote",
            f"service.inference_service.url={serve_url}",
            "service.train_service.backend=remote",
            f"service.train_service.url={train_url}",
            # two optimizer steps a batch: the old-logprob pass runs (one step a batch
            # skips it, tests/unit/training/test_service.py) and its agreement with the
            # served logprobs is logged
            "algorithm.num_mini_batches=2",
        )
        controller = NexRLController(cfg)
        controller.run()
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
    lines = [
        json.loads(x) for x in (Path(controller.run_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    train = [x for x in lines if "train/loss" in x]
    assert [x["step"] for x in train] == [1, 2, 3]
    # the server sampled with the weights the train service produced: logprobs agree
    assert max(x["train/behavior_old_logprob_absdiff"] for x in train) < 1e-4
    assert train[-1]["rollout/serving_version"] == 2
