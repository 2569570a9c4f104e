"""`NexRLModule`: the base every component derives from.

A module has a name, an activity tracker proxy and a health check. Modules
with a background loop (rollout workers, the algorithm processor, the train
worker) derive from `LoopModule`: they hold a `LoopThread` in `self._loop`
(composition, not thread inheritance) and get run / stop / health_check from it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nexrl.monitoring.activity import ActivityTrackerProxy

logger = logging.getLogger(__name__)

# How long a module loop's blocking get (admission, a batch) waits for its event before
# the loop asks again: in Ray mode every ask is an actor call, so an idle loop makes
# ~20 of them a second instead of one per `LoopThread` idle sleep (5 ms).
BLOCKING_GET_WAIT_S = 0.05


class NexRLModule:
    """Common surface of all modules: name, activity tracker, health check."""

    def __init__(self) -> None:
        self._module_name: str = "invalid"
        self._activity_tracker: ActivityTrackerProxy | None = None

    def set_activity_tracker(self, tracker: ActivityTrackerProxy) -> None:
        self._activity_tracker = tracker

    def set_module_name(self, module_name: str) -> None:
        self._module_name = module_name

    def get_module_name(self) -> str:
        return self._module_name

    def health_check(self) -> bool:
        return True

    def easy_dump(
        self,
        value: object,
        keys: Iterable[str] = (),
        value_formatter: Callable[[object], str] = repr,
    ) -> str:
        """Log `value` (or the given keys of a dict value) with the module's name."""
        if keys and isinstance(value, dict):
            value = {k: value.get(k) for k in keys}
        text = f"[{self._module_name}] {value_formatter(value)}"
        logger.debug(text)
        return text


class LoopThread:
    """Runs `body()` repeatedly in a daemon thread until `stop()`.

    `body` returns True when it did work and False when it found none; the
    loop sleeps `idle_sleep` seconds after an idle call so that polling does
    not burn a core. Exceptions escaping `body` end the loop and are kept in
    `error` so that the owner's health check can report them.
    """

    def __init__(self, name: str, body: Callable[[], bool], idle_sleep: float = 0.005) -> None:
        self._name = name
        self._body = body
        self._idle_sleep = idle_sleep
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self.error = None  # a loop started again (after a rewind) starts healthy
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._body():
                    self._stop.wait(self._idle_sleep)
        except BaseException as exc:  # noqa: BLE001 - kept for the health check
            self.error = exc
            logger.exception("loop %s died", self._name)

    def stop(self, timeout: float | None = 30.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None


class LoopModule(NexRLModule):
    """A module whose work is one `LoopThread` in `self._loop` (processor, train worker)."""

    _loop: LoopThread

    def run(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

    def pause(self) -> None:
        """Stop the loop but keep what `stop` releases (reward workers): `run` resumes it
        (a Ray rewind pauses every loop, restores a checkpoint, then runs them again)."""
        self._loop.stop()

    def health_check(self) -> bool:
        return self._loop.error is None
