"""Records of in-flight work: `ActivityLedger`, and the one of each module actor's process.

The central `ActivityTracker` keeps a ledger. In Ray mode each module actor keeps one
more for its own process (`serve_process_ledger`, called when the actor starts): the
`track(...)` brackets of the modules it hosts are then written there, in memory, instead
of being a round trip to the tracker actor each (two per rollout task, one of them
waited for). The tracker reads the actors' ledgers (`ModuleActor.activity_snapshot`)
when it is asked whether work is in flight; those questions are rare (end of data, end
of the run, a rewind), the brackets are not.

A process that serves no ledger (local mode, the driver, data-parallel train ranks)
brackets its work at the central tracker, as before.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkItem:
    """One piece of work in flight: which module, what, and for how many seconds."""

    module: str
    work: str
    age_s: float


class ActivityLedger:
    """Thread-safe `start(module, work) -> token` / `end(token)` record."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inflight: dict[str, tuple[str, str, float]] = {}  # token -> (module, work, t0)
        self._ids = itertools.count()

    def start(self, module: str, work: str) -> str:
        token = f"{module}:{next(self._ids)}"
        with self._cond:
            self._inflight[token] = (module, work, time.monotonic())
        return token

    def end(self, token: str) -> None:
        with self._cond:
            if self._inflight.pop(token, None) is None:
                raise ValueError(f"ActivityTracker.end: unknown or already ended token {token!r}")
            self._cond.notify_all()

    def items(self) -> list[WorkItem]:
        """What is in flight now, oldest first."""
        now = time.monotonic()
        with self._cond:
            entries = sorted(self._inflight.values(), key=lambda e: e[2])
        return [WorkItem(module, work, now - t0) for module, work, t0 in entries]

    def is_empty(self) -> bool:
        with self._cond:
            return not self._inflight

    def wait_empty(self, timeout: float | None) -> bool:
        """Block until nothing is in flight; False if `timeout` seconds pass first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._inflight, timeout=timeout)

    def forget(self, module: str) -> int:
        """Drop `module`'s work (its process died); returns how many items were dropped."""
        with self._cond:
            gone = [t for t, (m, _, _) in self._inflight.items() if m == module]
            for token in gone:
                del self._inflight[token]
            self._cond.notify_all()
        return len(gone)


_PROCESS_LEDGER = ActivityLedger()
_SERVED = False


def serve_process_ledger() -> ActivityLedger:
    """Make this process's ledger the one its modules bracket work in; the caller must
    also make it readable by the tracker (`ActivityTracker.add_source`)."""
    global _SERVED
    _SERVED = True
    return _PROCESS_LEDGER


def served_ledger() -> ActivityLedger | None:
    """This process's ledger if it is served to the tracker, else None."""
    return _PROCESS_LEDGER if _SERVED else None
