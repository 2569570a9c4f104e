"""The tracker calls a process does not wait for, sent to a Ray tracker actor in batches.

Each rollout task ends its `track` bracket and bumps a ledger counter: two tracker
calls that nothing waits for. As separate Ray calls they cost the calling process
about 0.1 ms of interpreter time each (taken from the engine thread beside it) and
the tracker actor a thread dispatch each. An `Outbox` queues them and one sender
thread per process and tracker delivers the queue as a single `apply` call, one
batch at a time and in order, so a batch never overtakes the one before it.

Only calls that commute with each other are queued (`end`, `increment`): their
order inside the tracker does not matter, and `start` is still waited for, so an
`end` can never arrive before its `start`. Readers in the same process call
`flush()` first and see their own calls; readers elsewhere see them one batch
later (milliseconds), which quiescence checks and counters already allow for.
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Any

from nexrl.execute import execute

logger = logging.getLogger(__name__)

QUEUED = frozenset({"end", "increment"})
"""The tracker methods an `Outbox` may carry (commuting, nothing waits for them)."""

_BOXES: dict[str, Outbox] = {}
_BOXES_LOCK = threading.Lock()


class Outbox:
    """Queue of `(method, args)` for one tracker actor, sent by a daemon thread."""

    def __init__(self, central: Any) -> None:
        self._central = central
        self._cond = threading.Condition()
        self._queue: list[tuple[str, tuple]] = []
        self._sending = False
        self._thread = threading.Thread(target=self._run, name="tracker-outbox", daemon=True)
        self._thread.start()

    def put(self, method: str, *args: Any) -> None:
        if method not in QUEUED:
            raise ValueError(f"Outbox: {method!r} is not one of the queued calls {set(QUEUED)}")
        with self._cond:
            self._queue.append((method, args))
            self._cond.notify_all()

    def flush(self, timeout: float = 30.0) -> None:
        """Return once every call queued so far has been applied by the tracker."""
        with self._cond:
            self._cond.notify_all()
            done = self._cond.wait_for(lambda: not self._queue and not self._sending, timeout)
        if not done:
            logger.warning(
                "tracker outbox: %d calls still queued after %g s", len(self._queue), timeout
            )

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue))
                batch, self._queue = self._queue, []
                self._sending = True
            try:
                execute(self._central.apply, batch)
            except Exception as exc:  # the tracker is gone (shutdown) or the call failed
                logger.warning("tracker outbox: %d calls not delivered: %r", len(batch), exc)
            finally:
                with self._cond:
                    self._sending = False
                    self._cond.notify_all()


def outbox_for(central: Any) -> Outbox:
    """This process's outbox for the tracker actor `central` (one sender thread each)."""
    key = str(getattr(central, "_actor_id", id(central)))
    with _BOXES_LOCK:
        box = _BOXES.get(key)
        if box is None:
            box = _BOXES[key] = Outbox(central)
        return box


@atexit.register
def _flush_all() -> None:
    for box in list(_BOXES.values()):
        box.flush(timeout=2.0)
