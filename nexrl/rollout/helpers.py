"""`HelperThreads`: a few threads that run one function together, on demand.

A rollout worker runs several validation tasks side by side on them
(`validate.concurrency`, nexrl/rollout/base.py). The threads are made once and park
between rounds: waking parked threads costs far less than starting new ones, which
matters when a validation round starts tens of them at once while they already
compete for the interpreter.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class HelperThreads:
    """`count` threads; each `start()` runs `work()` once on every one of them."""

    def __init__(self, name: str, count: int, work: Callable[[], None]) -> None:
        self._name, self._count, self._work = name, count, work
        self._cv = threading.Condition()
        self._round = 0  # rounds started
        self._busy = 0  # threads still in the current round
        self._closed = False
        self._threads: list[threading.Thread] = []
        self.error: BaseException | None = None  # the first `work()` that raised

    def start(self) -> None:
        """Run `work()` on every thread (made on the first call)."""
        with self._cv:
            if self._closed:
                raise RuntimeError(f"{self._name}: helper threads are closed")
            self._cv.wait_for(lambda: self._busy == 0)  # a round left running ends first
            if not self._threads:
                for i in range(self._count):
                    thread = threading.Thread(target=self._run, name=f"{self._name}-{i}")
                    thread.daemon = True
                    self._threads.append(thread)
                    thread.start()
            self._round += 1
            self._busy = self._count
            self._cv.notify_all()

    @property
    def busy(self) -> bool:
        """Some thread is still in the current round."""
        return self._busy > 0

    def wait(self, timeout: float | None = None) -> bool:
        """Until the round is over (True) or `timeout` s have passed (False)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._busy == 0, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Let the threads end once their current round is over."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for thread in self._threads:
            thread.join(timeout)

    def _next_round(self, seen: int) -> bool:
        """A round after round `seen` started, or the helpers are closing (under `_cv`)."""
        return self._round != seen or self._closed

    def _run(self) -> None:
        seen = 0
        while True:
            with self._cv:
                self._cv.wait_for(functools.partial(self._next_round, seen))
                if self._closed:
                    return
                seen = self._round
            try:
                self._work()
            except BaseException as exc:  # noqa: BLE001 - kept for the owner's health check
                self.error = self.error or exc
                logger.exception("%s: helper failed", self._name)
            finally:
                with self._cv:
                    self._busy -= 1
                    self._cv.notify_all()
