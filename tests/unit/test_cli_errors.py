"""Known user errors end `nexrl` with one line, not a traceback: Ctrl-C, a CUDA device on
a machine without one, a bad `--model`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from nexrl import cli

NO_GPU = not torch.cuda.is_available()


def test_train_on_cuda_without_a_gpu_is_one_line_before_anything_loads(capsys, tmp_path):
    code = cli.main(
        ["train", "+service.inference_service.engine.device=cuda", f"output_dir={tmp_path}"]
    )
    err = capsys.readouterr().err
    if NO_GPU:
        assert code == 2 and err.count("\n") == 1
        assert err.startswith("nexrl train: service.inference_service.engine.device=cuda but")
        assert not any(tmp_path.iterdir())  # no run folder: nothing started
    else:
        assert "no CUDA GPU" not in err


def test_serve_on_cuda_without_a_gpu_is_a_usage_error(capsys):
    from nexrl.inference import serve

    parser = serve.build_parser()
    args = parser.parse_args(["--device", "cuda"])
    if NO_GPU:
        with pytest.raises(SystemExit) as exit_info:
            serve.check_args(parser, args)
        assert exit_info.value.code == 2
        assert "--device cuda: this machine has no CUDA GPU" in capsys.readouterr().err
    else:
        serve.check_args(parser, args)


def _terminal_sigint() -> None:
    """Ctrl-C as a terminal delivers it. A test run started in the background by a
    non-interactive shell ignores SIGINT, and a child inherits the ignore: Python then
    installs no KeyboardInterrupt handler and the run would never see the signal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_during_training_is_one_line(tmp_path, tiny_model_path):
    cmd = [
        sys.executable, "-m", "nexrl.cli", "train", f"model_path={tiny_model_path}",
        f"output_dir={tmp_path}", "train_worker.total_train_steps=100000",
        "rollout_worker.num_workers=2", "validate.validate_before_train=false",
        "logger.backend=[jsonl]",
    ]  # fmt: skip
    # faulthandler: a run that does not stop is aborted below with every thread's stack
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=_terminal_sigint,
    )
    deadline = time.monotonic() + 300
    for line in proc.stdout:  # the run has started once it names its folder
        if line.startswith("nexrl: run dir") or time.monotonic() > deadline:
            break
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=60)
        pytest.fail(f"the run did not stop within 120 s of Ctrl-C; its threads:\n{err[-6000:]}")
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    assert "nexrl train: interrupted (Ctrl-C); run dir" in err
