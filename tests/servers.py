"""Helpers for tests that run nexrl's servers as real processes."""

from __future__ import annotations


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
