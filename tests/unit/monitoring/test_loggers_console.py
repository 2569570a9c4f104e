"""The console backend: a live rich bar on a terminal, plain lines otherwise, and
default keys that the train worker and validator really emit."""

from __future__ import annotations

import io
import re
from pathlib import Path

from omegaconf import OmegaConf
from rich.console import Console

from nexrl.monitoring.progress import DEFAULT_CONSOLE_KEYS, ConsoleBackend

ROOT = Path(__file__).resolve().parents[3]


def test_default_console_keys_are_emitted_by_the_package() -> None:
    files = [p for p in (ROOT / "nexrl").rglob("*.py") if p.parent.name != "monitoring"]
    source = "\n".join(p.read_text() for p in files)
    emitted = set(re.findall(r'"((?:reward|val|throughput)/[a-z_]+)"', source))
    assert set(DEFAULT_CONSOLE_KEYS) <= emitted, set(DEFAULT_CONSOLE_KEYS) - emitted
    packaged = OmegaConf.load(ROOT / "nexrl/config/rl_train.yaml").logger.console_keys
    assert set(packaged) <= emitted, set(packaged) - emitted


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=terminal, width=140, highlight=False), out


def test_not_a_terminal_prints_one_plain_line_per_post() -> None:
    console, out = _console(terminal=False)
    backend = ConsoleBackend(console=console)
    assert not backend.live
    backend.total_steps = 4
    backend.log({"reward/mean": 0.25, "throughput/samples_per_s": 1200.0}, step=1)
    backend.log({"val/reward": 0.5}, step=1)
    backend.log({"ledger/tasks_in": 3}, step=1)  # nothing to show at a printed step
    backend.close()
    lines = out.getvalue().splitlines()
    assert lines == [
        "step 1/4 | reward/mean 0.25 | throughput/samples_per_s 1200",
        "step 1/4 | val/reward 0.5",
    ]
    assert "\x1b[" not in out.getvalue()  # no terminal control codes in a file


def test_terminal_shows_a_bar_with_latest_metrics_rate_and_eta() -> None:
    console, out = _console(terminal=True)
    backend = ConsoleBackend(console=console)
    assert backend.live
    backend.total_steps = 10
    status = backend.format_status({"reward/mean": 0.25}, step=2, now=100.0)
    assert status == "reward/mean 0.25"
    status = backend.format_status({"val/reward": 0.5}, step=2, now=100.0)
    assert status == "reward/mean 0.25 | val/reward 0.5"  # the train reward stays shown
    status = backend.format_status({"reward/mean": 0.75}, step=6, now=108.0)
    assert status == "reward/mean 0.75 | val/reward 0.5 | 2.00 s/step | ETA 0m08s"
    backend.log({"reward/mean": 0.8, "throughput/samples_per_s": 900.0}, step=7)
    backend.close()
    text = out.getvalue()
    assert "step 7/10" in text and "━" in text  # the bar itself
    assert "reward/mean 0.8" in text and "throughput/samples_per_s 900" in text


SCRIPT = """
from nexrl.monitoring import ExperimentLogger
log = ExperimentLogger(backends="console", total_steps=3)
for step in (1, 2, 3):
    log.post("metrics", data={"reward/mean": step / 4, "throughput/samples_per_s": 50.0}, step=step)
log.close()
"""


def _run_console_script(terminal: bool) -> str:
    """The console backend in a child process whose stdout is a pseudo-terminal or a pipe."""
    import os
    import pty
    import subprocess
    import sys

    if not terminal:
        proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout
    parent, child = pty.openpty()
    env = {**os.environ, "COLUMNS": "120", "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=child, stderr=child, env=env)
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(parent, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=120) == 0
    os.close(parent)
    return b"".join(chunks).decode(errors="replace")


def test_a_real_terminal_gets_the_bar_and_a_pipe_gets_plain_lines() -> None:
    on_tty = _run_console_script(terminal=True)
    assert "━" in on_tty and "step 3/3" in on_tty and "\x1b[" in on_tty
    piped = _run_console_script(terminal=False)
    assert piped.splitlines()[0] == "step 1/3 | reward/mean 0.25 | throughput/samples_per_s 50"
    assert "━" not in piped and "\x1b[" not in piped


def test_two_bars_on_one_console_both_show() -> None:
    """Two loggers in one process (e.g. two runs from Python): rich nests live displays,
    or, where it refuses, the second falls back to plain lines; neither raises."""
    console, out = _console(terminal=True)
    first, second = ConsoleBackend(console=console), ConsoleBackend(console=console)
    first.log({"reward/mean": 0.5}, step=1)
    second.log({"reward/mean": 0.25}, step=1)
    first.close()
    second.close()
    assert "reward/mean 0.5" in out.getvalue() and "reward/mean 0.25" in out.getvalue()
