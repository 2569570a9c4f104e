"""Thread helpers of the reward runner: daemon worker threads, and in-order results of a job."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")


class DaemonExecutor:
    """`submit` / `shutdown` of a `ThreadPoolExecutor` on daemon threads.

    Why: `concurrent.futures` joins its worker threads at interpreter exit, so one hung
    reward call kept a finished run's process alive until the call returned (5 min
    where 30 s were expected). A daemon thread is abandoned at exit instead. Threads
    start on demand, up to `max_workers`, and stay for the next job."""

    def __init__(self, max_workers: int, name: str) -> None:
        self._max, self._name = max_workers, name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0
        self._closed = False

    def submit(self, fn: Callable[..., _T], *args: object) -> concurrent.futures.Future[_T]:
        fut: concurrent.futures.Future[_T] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._jobs.put((fut, fn, args))
            if self._idle == 0 and self._threads < self._max:
                self._threads += 1
                name = f"{self._name}_{self._threads}"
                threading.Thread(target=self._work, name=name, daemon=True).start()
            else:
                self._idle -= 1 if self._idle else 0
        return fut

    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            fut, fn, args = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = False, cancel_futures: bool = False) -> None:
        """Idle threads end; running calls are not waited for (`wait` is accepted for
        `ThreadPoolExecutor` compatibility and ignored)."""
        with self._lock:
            self._closed = True
            threads = self._threads
        while cancel_futures:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(threads):
            self._jobs.put(None)


class InOrderJob:
    """The results of one pool-thread job, in call order, behind one condition for the
    whole group (a future per call made a lock and a condition each: 256 per train
    step of the default run).

    The job wakes its caller once, when its last call ends or a call fails, not at every
    result: a wake-up is a thread switch, and 16 of them per group kept the caller
    waiting on the interpreter. A hung call is found by the caller's own clock: each
    call may run `timeout` seconds from when the call before it ended (`since`)."""

    def __init__(self, calls: int) -> None:
        self._cond = threading.Condition()
        self._results: list[tuple[bool, Any]] = []
        self._calls = calls
        self.since = time.monotonic()  # when the running call started (or was queued)
        self.abandoned = False

    def post(self, ok: bool, value: Any) -> None:
        with self._cond:
            self._results.append((ok, value))
            self.since = time.monotonic()
            if not ok or len(self._results) == self._calls:
                self._cond.notify()

    def wait(self, index: int, timeout: float) -> tuple[bool, Any] | None:
        """Result `index` (ok, value), or None if the call that is to give it (or one
        before it) ran `timeout` s without ending."""
        with self._cond:
            while len(self._results) <= index:
                left = self.since + timeout - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._results[index]
