"""The reward calling layer: one interface for every reward function.

A reward may be written in either of two shapes, told apart by
`inspect.signature` (no registration flag to forget; the call shape lives in
nexrl/rewards/calls.py):

- nexrl's `reward(prompt, completion, **row)`;
- the AReaL-lite seed's `reward_fn(prompt, completion, prompt_ids, completion_ids, **kwargs)`
  (recognised by a parameter named `prompt_ids` or `completion_ids`).

Either may be `async def`. It returns a float, a `RewardResult`, or a dict with
`reward` and optional `scores` (named components, logged separately).

`RewardRunner` calls it in-thread or in a process pool (pebble: a hung call is
killed after `timeout_s`, a crashed worker - even a segfault or `os._exit` - is
replaced) and never raises for a failing reward: the `RewardOutcome` says what
failed (`timeout`, `crash`, `exception`) so the rollout worker can report and
count it. A failure is never turned into a 0 reward here; `reward` is None.

Without the process pool a timed-out synchronous reward keeps running in its
thread (Python cannot kill a thread): the caller is unblocked, the timeout is
counted, and the thread is abandoned. Reward threads are daemon threads
(`DaemonExecutor`), so an abandoned one never keeps the process from exiting;
what is lost is that thread and whatever it holds until the reward returns (CPU,
memory, an open connection). Use the pool for rewards that may hang for good.

A reward marked `@inline_reward` (a string comparison: no I/O, time bounded by
its input) runs in the caller's thread even with a timeout: it cannot outlive
one, and the hop to a timing thread costs more than its body.

`score_many` scores a group (a rollout worker's samples of one task) with one
thread hop instead of one per sample: the reward's call shape is worked out
once (`PreparedReward`), so the per-item cost is the reward's own plus a few
microseconds. A cheap reward runs while the in-process inference engine waits
for the GIL, so this overhead slows generation directly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import multiprocessing
import re
import threading
import time
from collections.abc import Awaitable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple, TypeAlias, TypeVar

from nexrl.rewards.calls import (
    PreparedReward,
    RewardFn,
    RewardResult,
    call_reward,
    inline_reward,
    normalize_result,
)
from nexrl.rewards.executors import DaemonExecutor, InOrderJob
from nexrl.types import JSONValue

if TYPE_CHECKING:
    from pebble import ProcessPool
    from typing_extensions import Unpack

RewardArgs: TypeAlias = "tuple[JSONValue, str, list[int], list[int], Mapping[str, object]]"
"""One reward call: (prompt, completion, prompt_ids, completion_ids, row); the prompt is
the row's prompt column (text, or chat messages)."""
Scored: TypeAlias = "tuple[float, dict[str, float]]"
"""(reward, named components), as `normalize_result` returns them."""
_T = TypeVar("_T")

__all__ = [
    "FAILURE_KINDS",
    "PreparedReward",
    "RewardCall",
    "RewardOutcome",
    "RewardResult",
    "RewardRunner",
    "call_reward",
    "inline_reward",
    "normalize_result",
]

FailureKind = Literal["timeout", "crash", "exception"]
FAILURE_KINDS: tuple[str, ...] = ("timeout", "crash", "exception")


@dataclass
class RewardOutcome:
    """The result of one reward call. `error` is None on success, else the failure kind."""

    reward: float | None
    scores: dict[str, float] = field(default_factory=dict)
    error: FailureKind | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None


class RewardCall(NamedTuple):
    """The arguments of one reward call, for `RewardRunner.score_many`."""

    prompt: JSONValue
    completion: str
    prompt_ids: list[int] | None = None
    completion_ids: list[int] | None = None
    row: Mapping[str, object] | None = None

    def args(self) -> RewardArgs:
        prompt_ids, completion_ids = list(self.prompt_ids or []), list(self.completion_ids or [])
        return (self.prompt, self.completion, prompt_ids, completion_ids, self.row or {})


def _call_in_worker(call: PreparedReward, *args: Unpack[RewardArgs]) -> Scored:
    """Process-pool entry point: runs an async reward to completion in the worker."""
    value = call(*args)
    if inspect.isawaitable(value):
        value = asyncio.run(_await(value))
    return normalize_result(value)


async def _await(value: Awaitable[_T]) -> _T:
    return await value


class RewardRunner:
    """Calls one reward function with a timeout, in-thread or in a process pool.

    Usage order: build once per rollout worker, call `score` / `score_many` (blocking)
    or `ascore` (async) from any number of threads / tasks, `close()` at shutdown.
    `stats` counts calls and failures by kind.
    """

    def __init__(
        self,
        fn: RewardFn,
        *,
        timeout_s: float | None = 30.0,
        use_process_pool: bool = False,
        max_workers: int = 2,
        start_method: str = "forkserver",
    ) -> None:
        if not callable(fn):
            raise TypeError(f"reward function {fn!r} is not callable")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"reward timeout_s must be > 0 or None, got {timeout_s}")
        self._call = PreparedReward.of(fn)  # fails now, with the function's name, if it has none
        self.timeout_s = timeout_s
        self.is_async = self._call.is_async
        self.seed_signature = self._call.seed_signature
        self._pool: ProcessPool | None = None
        if use_process_pool:
            from pebble import ProcessPool

            self._pool = ProcessPool(
                max_workers=max_workers, context=multiprocessing.get_context(start_method)
            )
        self._inline = (
            not use_process_pool and not self.is_async and (timeout_s is None or self._call.inline)
        )
        self._threads = DaemonExecutor(max(64, max_workers), "reward")
        self._lock = threading.Lock()
        self.stats: dict[str, int] = {"calls": 0, **dict.fromkeys(FAILURE_KINDS, 0)}

    @property
    def fn(self) -> RewardFn:
        """The reward function (fixed: its call shape was worked out at construction)."""
        return self._call.fn

    @property
    def runs_inline(self) -> bool:
        """Whether `score` and `score_many` call the reward in the caller's thread: a
        synchronous reward without a timeout or marked `@inline_reward`, no process pool."""
        return self._inline

    # -- public API --------------------------------------------------------

    def score(
        self,
        prompt: JSONValue,
        completion: str,
        prompt_ids: list[int] | None = None,
        completion_ids: list[int] | None = None,
        row: Mapping[str, object] | None = None,
    ) -> RewardOutcome:
        """Blocking call; safe from any thread (not from inside a running event loop).
        A sync reward without a timeout, or marked `@inline_reward`, runs in the caller's
        thread (no thread hop)."""
        args = RewardCall(prompt, completion, prompt_ids, completion_ids, row).args()
        if self._pool is not None:
            return self._record(self._outcome_of(self._schedule(args), None))
        if self.is_async:
            fut = self._threads.submit(asyncio.run, self._acall_inline(*args))
        elif self._inline:
            return self._record(self._inline_outcome(args))
        else:
            fut = self._threads.submit(self._call_inline, *args)
        return self._record(self._outcome_of(fut, self.timeout_s))

    def score_many(self, items: Sequence[RewardCall]) -> list[RewardOutcome]:
        """`score` of every item, in order, with one thread hop per group instead of one
        per item; each item fails on its own (see `iter_scores`)."""
        return list(self.iter_scores(items))

    def iter_scores(self, items: Sequence[RewardCall]) -> Generator[RewardOutcome, None, None]:
        """Yield each item's outcome, in order (blocking, like `score`, with the same
        failure kinds per item; never raises for a reward).

        - process pool: every item is scheduled at once, each killed after `timeout_s`;
        - async reward: all items run concurrently in one event loop on one pool
          thread, each under `timeout_s`;
        - sync reward: the items run one after the other in one pool-thread job, whose
          outcomes come when its last item ends or an item fails. Item i may take
          `timeout_s` from when item i-1 ended (item 0: from when the job was
          queued). A hung item gets the `timeout` outcome and the items after it go
          to a new job; the hung thread cannot be killed and keeps running, as for
          `score`. Without a timeout, or marked `@inline_reward`, the items run in
          the caller's thread.

        Closing the iterator early (the rollout worker stops at the first failure)
        cancels the items not started yet; closing the runner before an async group's
        job started fails its items (`CancelledError`) instead of leaving them waiting.
        """
        calls = [item.args() for item in items]
        if not calls:
            return
        if self._pool is None and not self.is_async:
            yield from self._iter_in_order(calls)
            return
        deadline = None
        if self._pool is not None:
            futures = [self._schedule(args) for args in calls]
        else:
            futures = [concurrent.futures.Future() for _ in calls]
            job = self._threads.submit(lambda: asyncio.run(self._agather(calls, futures)))
            job.add_done_callback(lambda job: _cancel_if_cancelled(job, futures))
            if self.timeout_s is not None:
                deadline = time.monotonic() + self.timeout_s
        try:
            for fut in futures:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                yield self._record(self._outcome_of(fut, wait))
        finally:
            for fut in futures:
                fut.cancel()

    async def ascore(
        self,
        prompt: JSONValue,
        completion: str,
        prompt_ids: list[int] | None = None,
        completion_ids: list[int] | None = None,
        row: Mapping[str, object] | None = None,
    ) -> RewardOutcome:
        """Awaitable call: the event loop is never blocked by the reward."""
        args = RewardCall(prompt, completion, prompt_ids, completion_ids, row).args()
        if self._pool is not None:
            fut = self._schedule(args)
            await asyncio.wait({asyncio.wrap_future(fut)})  # never raises; classified below
            return self._record(self._outcome_of(fut, None))
        task: asyncio.Future[Scored]
        if self.is_async:
            task = asyncio.ensure_future(self._acall_inline(*args))
        else:
            task = asyncio.wrap_future(self._threads.submit(self._call_inline, *args))
        try:
            reward, scores = await asyncio.wait_for(task, self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a failing reward is an outcome, not a crash
            return self._record(self._failure(exc))
        return self._record(RewardOutcome(reward, scores))

    def close(self) -> None:
        """Stop the worker processes (hung calls are killed) and the threads."""
        if self._pool is not None:
            self._pool.stop()
            self._pool.join(timeout=10)
            self._pool = None
        self._threads.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------

    def _schedule(self, args: RewardArgs) -> concurrent.futures.Future[Scored]:
        """One call in the process pool; pebble kills it after `timeout_s`."""
        assert self._pool is not None  # called only with a pool
        return self._pool.schedule(
            _call_in_worker, args=(self._call, *args), timeout=self.timeout_s
        )

    def _call_inline(self, *args: Unpack[RewardArgs]) -> Scored:
        return normalize_result(self._call(*args))

    async def _acall_inline(self, *args: Unpack[RewardArgs]) -> Scored:
        value = self._call(*args)
        if inspect.isawaitable(value):
            value = await value
        return normalize_result(value)

    def _inline_outcome(self, args: RewardArgs) -> RewardOutcome:
        try:
            reward, scores = self._call_inline(*args)
        except Exception as exc:  # noqa: BLE001 - see ascore
            return self._failure(exc)
        return RewardOutcome(reward, scores)

    def _iter_in_order(self, calls: list[RewardArgs]) -> Iterator[RewardOutcome]:
        """`iter_scores` of a sync reward: one pool-thread job, a new one after a hang."""
        if self._inline:
            for args in calls:
                yield self._record(self._inline_outcome(args))
            return
        timeout_s = self.timeout_s
        assert timeout_s is not None, "a sync reward without timeout_s runs inline"
        done = 0
        while done < len(calls):
            job = InOrderJob(len(calls) - done)
            self._threads.submit(self._run_in_order, calls[done:], job)
            try:
                for i in range(len(calls) - done):
                    result = job.wait(i, timeout_s)
                    done += 1
                    if result is None:  # hung: the rest go to a new job
                        yield self._record(self._failure(TimeoutError()))
                        break
                    yield self._record(self._outcome_from(result))
            finally:
                job.abandoned = True  # the job skips what it has not started

    def _run_in_order(self, calls: list[RewardArgs], job: InOrderJob) -> None:
        """Pool-thread job: each call in turn, its result posted as soon as it is known."""
        for args in calls:
            if job.abandoned:
                return  # the caller moved on after an earlier item hung
            try:
                job.post(True, self._call_inline(*args))
            except BaseException as exc:  # noqa: BLE001 - classified by the caller
                job.post(False, exc)

    def _outcome_from(self, result: tuple[bool, Scored | BaseException]) -> RewardOutcome:
        ok, value = result
        if isinstance(value, BaseException):
            return self._failure(value)
        reward, scores = value
        return RewardOutcome(reward, scores)

    async def _agather(
        self, calls: list[RewardArgs], futures: list[concurrent.futures.Future[Scored]]
    ) -> None:
        """Pool-thread job of an async reward: every call in one loop, each timed out."""

        async def one(args: RewardArgs, fut: concurrent.futures.Future[Scored]) -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(await asyncio.wait_for(self._acall_inline(*args), self.timeout_s))
            except BaseException as exc:  # noqa: BLE001 - classified by the caller
                fut.set_exception(exc)

        await asyncio.gather(*(one(args, fut) for args, fut in zip(calls, futures, strict=True)))

    def _outcome_of(self, fut: concurrent.futures.Future, timeout: float | None) -> RewardOutcome:
        try:
            reward, scores = fut.result(timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - see ascore
            return self._failure(exc)
        return RewardOutcome(reward, scores)

    def _failure(self, exc: BaseException) -> RewardOutcome:
        """The outcome of a failed call; a timeout is ours, pebble's or the reward's own."""
        if isinstance(exc, (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError)):
            return RewardOutcome(
                None, error="timeout", detail=f"reward exceeded {self.timeout_s} s"
            )
        if self._pool is not None:
            from pebble import ProcessExpired

            if isinstance(exc, ProcessExpired):
                code = getattr(exc, "exitcode", None)
                detail = f"reward worker died: {exc} (exit code {code})"
                return RewardOutcome(None, error="crash", detail=detail)
        return _exception(exc)

    def _record(self, outcome: RewardOutcome) -> RewardOutcome:
        with self._lock:
            self.stats["calls"] += 1
            if outcome.error is not None:
                self.stats[outcome.error] += 1
        return outcome


def _exception(exc: BaseException) -> RewardOutcome:
    detail = f"{type(exc).__name__}: {exc}{_where(exc)}"
    return RewardOutcome(None, error="exception", detail=detail)


def _where(exc: BaseException) -> str:
    """` (at file:line in function)` of the innermost frame that raised `exc` (a reward
    run in a worker process carries its traceback as text in `__cause__`)."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', str(exc.__cause__ or ""))
    if frames:
        return f" (at {frames[-1][0]}:{frames[-1][1]} in {frames[-1][2]})"
    tb = exc.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return f" (at {code.co_filename}:{tb.tb_lineno} in {code.co_name})"


def _cancel_if_cancelled(
    job: concurrent.futures.Future, futures: list[concurrent.futures.Future]
) -> None:
    """A group's job cancelled before it ran (`close`): its items will never be set."""
    if job.cancelled():
        for fut in futures:
            fut.cancel()
