"""`EventLoopThread`: an asyncio event loop that runs in a thread of its own.

Synchronous code (a rollout worker's loop, a training script, a reward runner) hands
coroutines to it and waits for their results. Everything handed to one
`EventLoopThread` runs on the same loop, which outlives each call: concurrent
episodes of a workflow can share loop-bound state (an MCP session, an async HTTP
client) across tasks, and no loop is made and torn down per call.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class EventLoopThread:
    """A running event loop on a daemon thread named `name`.

    executor_threads: size of the loop's default executor (`asyncio.to_thread`,
        `run_in_executor(None, ...)`); None keeps asyncio's default (min(32, CPUs + 4)),
        too few when more blocking calls than that are in flight at once.
    """

    def __init__(self, name: str, executor_threads: int | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self._executor: ThreadPoolExecutor | None = None
        if executor_threads is not None:
            self._executor = ThreadPoolExecutor(executor_threads, thread_name_prefix=f"{name}-io")
            self.loop.set_default_executor(self._executor)
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def executor(self) -> ThreadPoolExecutor | None:
        """The sized default executor (None: asyncio's own)."""
        return self._executor

    def submit(self, coro: Coroutine[object, None, T]) -> Future[T]:
        """Schedule `coro` on the loop; its result comes through the returned future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[object, None, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result (its exception is raised here)."""
        return self.submit(coro).result(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Cancel what still runs on the loop, stop it and join its thread. Threads of the
        executor still in a blocking call are not waited for. Calling it again is a no-op."""
        if self.loop.is_closed():
            return
        if self.loop.is_running():
            self.run(_cancel_all(), timeout)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if not self._thread.is_alive():
            self.loop.close()


async def _cancel_all() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
