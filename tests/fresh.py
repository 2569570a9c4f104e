"""Run code in a fresh interpreter, for tests of what a process imports or starts first."""

from __future__ import annotations

import subprocess
import sys


def run_fresh(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -c code` with nothing imported yet; fails the test on a non-zero exit."""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
