"""Tracker calls that nothing waits for, sent to a Ray tracker actor in batches.

Every rollout task opens a `track` bracket, closes it and bumps a ledger counter:
three tracker calls. As separate Ray calls they cost the calling process about
0.1 ms of interpreter time each (taken from the engine thread beside it), the
tracker actor a thread dispatch each, and a waited `start` a round trip before
the task reached the engine. An `Outbox` queues them instead; one sender thread
per process and tracker delivers the queue as a single `apply` call, one batch at
a time, in order. So a `start` always reaches the tracker before its `end`.

What a reader sees: readers in the same process `flush()` first and see every
earlier call. A reader in another process may see a `start` a few milliseconds
late; the checks where that matters (the end of the run, a Ray rewind) first flush
every actor's outbox (`flush_all` through `RaySystem.flush_tracker`), and the
trajectory pool's end-of-data check is exact without the tracker (the task
ledger, nexrl/rollout/admission.py).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import TYPE_CHECKING, TypeAlias

from nexrl.execute import execute

if TYPE_CHECKING:
    from nexrl.monitoring.activity import ActivityTracker

logger = logging.getLogger(__name__)

QueuedCall: TypeAlias = (
    "tuple[str, tuple[object, ...]] | tuple[str, tuple[object, ...], dict[str, object]]"
)
"""One call for `ActivityTracker.apply`: `(method, args)` or `(method, args, kwargs)`."""

LINGER_S = 0.05
"""How long the sender lets a batch fill after its first call before sending it (a
`flush` sends at once): the calls of a step's burst of tasks then travel in a few Ray
calls instead of one each, and wake the tracker's process less often (one actor:
4.5-5 a step at 10 ms, 2.5 at 50 ms; benchmarks/results/ray.md)."""

QUEUED = frozenset({"start", "end", "increment", "set_training_step", "experiment_logger_post"})
"""The tracker methods an `Outbox` may carry (nothing waits for their results)."""

_BOXES: dict[str, Outbox] = {}
_BOXES_LOCK = threading.Lock()


class Outbox:
    """Queue of `(method, args)` for one tracker actor, sent by a daemon thread."""

    def __init__(self, central: ActivityTracker) -> None:
        self._central = central
        self._cond = threading.Condition()
        self._queue: list[QueuedCall] = []
        self._sending = False
        self._flushing = 0  # flush() calls waiting: send without lingering
        self._thread = threading.Thread(target=self._run, name="tracker-outbox", daemon=True)
        self._thread.start()

    def put(self, method: str, *args: object, **kwargs: object) -> None:
        if method not in QUEUED:
            raise ValueError(f"Outbox: {method!r} is not one of the queued calls {set(QUEUED)}")
        with self._cond:
            self._queue.append((method, args, kwargs))
            self._cond.notify_all()

    def flush(self, timeout: float = 30.0) -> None:
        """Return once every call queued so far has been applied by the tracker."""
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
            done = self._cond.wait_for(lambda: not self._queue and not self._sending, timeout)
            self._flushing -= 1
        if not done:
            logger.warning(
                "tracker outbox: %d calls still queued after %g s", len(self._queue), timeout
            )

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue))
                self._linger()
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

    def _linger(self) -> None:
        """Let more calls join the batch for up to `LINGER_S` (holding `_cond`)."""
        deadline = time.monotonic() + LINGER_S
        while not self._flushing and (left := deadline - time.monotonic()) > 0:
            self._cond.wait(left)


def outbox_for(central: ActivityTracker) -> Outbox:
    """This process's outbox for the tracker actor `central` (one sender thread each)."""
    key = str(getattr(central, "_actor_id", id(central)))
    with _BOXES_LOCK:
        box = _BOXES.get(key)
        if box is None:
            box = _BOXES[key] = Outbox(central)
        return box


@atexit.register
def flush_all(timeout: float = 2.0) -> None:
    """Deliver every call queued in this process so far (to every tracker)."""
    with _BOXES_LOCK:
        boxes = list(_BOXES.values())
    for box in boxes:
        box.flush(timeout=timeout)
