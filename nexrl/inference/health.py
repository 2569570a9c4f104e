"""Engine fault vocabulary: the errors callers see, OOM recognition, the restart budget.

A served engine can die (killed, out of memory) or hang. The supervisor
(`ProcessEngine`) restarts it; what a caller sees depends on whether its
request could be replayed:

- `EngineRestartedError` (retryable): the engine restarted while the request
  was in flight and it could not be replayed transparently (tokens had already
  been streamed, or it was replayed `max_request_retries` times already). The
  caller may send it again; a rollout worker counts it as a failed attempt and
  re-queues the task (its `max_task_retries`).
- `EngineDeadError` (not retryable): the restart budget is spent (more than
  `max_restarts` restarts within `restart_window_s`); the engine stays down so
  that a crash loop is reported instead of hidden.
"""

from __future__ import annotations

import time
from collections import deque

from nexrl.spawn import UNGUARDED_MAIN, UNGUARDED_MAIN_EXIT_CODE

OOM_EXIT_CODE = 75
"""Exit status of an engine process that stopped itself after running out of memory."""

_OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory")


class EngineRestartedError(RuntimeError):
    """The engine restarted under this request; sending it again is safe."""

    retryable = True


class EngineDeadError(RuntimeError):
    """The engine crashed more often than its restart budget allows; it stays down."""

    retryable = False


def is_oom(exc: BaseException) -> bool:
    """True for host or accelerator out-of-memory errors (torch raises them as RuntimeError)."""
    if isinstance(exc, MemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _OOM_MARKERS)


def describe_exit(exitcode: int | None) -> str:
    """A process exit status in words, for the restart log."""
    if exitcode is None:
        return "still running"
    if exitcode == OOM_EXIT_CODE:
        return "stopped after running out of memory"
    if exitcode == UNGUARDED_MAIN_EXIT_CODE:
        return UNGUARDED_MAIN
    if exitcode < 0:
        import signal

        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = str(-exitcode)
        hint = " (the kernel's OOM killer sends SIGKILL too)" if name == "SIGKILL" else ""
        return f"killed by {name}{hint}"
    return f"exited with status {exitcode}"


class RestartBudget:
    """At most `max_restarts` restarts within any `window_s` seconds."""

    def __init__(self, max_restarts: int, window_s: float) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._times: deque[float] = deque()

    def take(self) -> bool:
        """Record a restart; False when it would exceed the budget (the engine stays down)."""
        now = time.monotonic()
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True
