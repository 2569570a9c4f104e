"""`EventLoopThread`: one loop for many callers, a sized executor, a clean close."""

import asyncio
import os
import threading
import time

import pytest

from nexrl.aio import EventLoopThread


def test_coroutines_from_several_threads_run_on_the_one_loop():
    loop_thread = EventLoopThread("t")
    loops = []

    async def note():
        loops.append(asyncio.get_running_loop())
        return threading.current_thread().name

    names = []
    callers = [threading.Thread(target=lambda: names.append(loop_thread.run(note())))]
    callers += [threading.Thread(target=lambda: names.append(loop_thread.run(note())))]
    for c in callers:
        c.start()
    for c in callers:
        c.join()
    assert names == ["t", "t"] and loops[0] is loops[1] is loop_thread.loop
    loop_thread.close()


def test_an_exception_reaches_the_caller():
    loop_thread = EventLoopThread("t")

    async def fail():
        raise KeyError("row 3")

    with pytest.raises(KeyError, match="row 3"):
        loop_thread.run(fail())
    loop_thread.close()


def test_the_executor_has_room_for_every_blocking_call():
    """One more blocking call than asyncio's default executor has threads, all in flight
    at once (a barrier of that many): only the sized executor lets them meet."""
    n = min(32, (os.cpu_count() or 1) + 4) + 1
    loop_thread = EventLoopThread("t", executor_threads=n)
    barrier = threading.Barrier(n, timeout=10)

    async def together():
        await asyncio.gather(*(asyncio.to_thread(barrier.wait) for _ in range(n)))

    loop_thread.run(together(), timeout=30)
    loop_thread.close()


def test_close_cancels_what_still_runs_and_is_idempotent():
    loop_thread = EventLoopThread("t")
    cancelled = threading.Event()

    async def forever():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    future = loop_thread.submit(forever())
    time.sleep(0.05)
    loop_thread.close()
    assert cancelled.is_set() and future.cancelled()
    assert loop_thread.loop.is_closed()
    loop_thread.close()
