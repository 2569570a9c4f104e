"""The reward calling layer: one interface for every reward function.

A reward may be written in either of two shapes, told apart by
`inspect.signature` (no registration flag to forget):

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
thread (Python cannot kill a thread): the caller is unblocked and the timeout
is counted, but use the pool for rewards that may hang.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import multiprocessing
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

FailureKind = Literal["timeout", "crash", "exception"]
FAILURE_KINDS: tuple[str, ...] = ("timeout", "crash", "exception")


@dataclass
class RewardResult:
    """What a reward may return instead of a float: the reward and its named components."""

    reward: float
    scores: dict[str, float] = field(default_factory=dict)


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


def _is_seed_signature(fn: Callable[..., Any]) -> bool:
    params = inspect.signature(fn).parameters
    return "prompt_ids" in params or "completion_ids" in params


def _row_filter(fn: Callable[..., Any]) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """Pass every row key to a `**kwargs` reward, only its named parameters otherwise.

    Why: `exact_match(prompt, completion, answer)` should not fail because the
    row also carries `index`.
    """
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict
    names = {
        n
        for n, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return lambda row: {k: v for k, v in row.items() if k in names}


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an object with `async def __call__`
    )


def normalize_result(value: Any) -> tuple[float, dict[str, float]]:
    """(reward, scores) from what a reward returned; a clear error for anything else."""
    if isinstance(value, RewardResult):
        reward, scores = value.reward, value.scores
    elif isinstance(value, Mapping):
        if "reward" not in value:
            raise ValueError(f"reward returned a dict without 'reward': keys {sorted(value)}")
        reward, scores = value["reward"], value.get("scores") or {}
    elif isinstance(value, (int, float)):  # bool included: True -> 1.0
        reward, scores = value, {}
    else:
        raise TypeError(
            f"reward returned {type(value).__name__}; expected a float, a dict with "
            "'reward' (and optional 'scores') or a RewardResult"
        )
    reward = float(reward)
    if not math.isfinite(reward):
        raise ValueError(f"reward returned a non-finite value {reward}")
    return reward, {str(k): float(v) for k, v in scores.items()}


def call_reward(
    fn: Callable[..., Any],
    prompt: str,
    completion: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    row: Mapping[str, Any],
) -> Any:
    """Call `fn` in the shape its signature asks for (coroutine for an async reward)."""
    kwargs = _row_filter(fn)(row)
    if _is_seed_signature(fn):
        return fn(prompt, completion, prompt_ids, completion_ids, **kwargs)
    return fn(prompt, completion, **kwargs)


def _call_in_worker(fn: Callable[..., Any], *args: Any) -> tuple[float, dict[str, float]]:
    """Process-pool entry point: runs an async reward to completion in the worker."""
    value = call_reward(fn, *args)
    if inspect.isawaitable(value):
        value = asyncio.run(_await(value))
    return normalize_result(value)


async def _await(value: Any) -> Any:
    return await value


class RewardRunner:
    """Calls one reward function with a timeout, in-thread or in a process pool.

    Usage order: build once per rollout worker, call `score` (sync) or `ascore`
    (async) from any number of threads / tasks, `close()` at shutdown. `stats`
    counts calls and failures by kind.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
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
        inspect.signature(fn)  # fail now, with the function's name, if it has none
        self.fn = fn
        self.timeout_s = timeout_s
        self.is_async = _is_async(fn)
        self.seed_signature = _is_seed_signature(fn)
        self._pool: Any = None
        if use_process_pool:
            from pebble import ProcessPool

            self._pool = ProcessPool(
                max_workers=max_workers, context=multiprocessing.get_context(start_method)
            )
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(64, max_workers), thread_name_prefix="reward"
        )
        self._lock = threading.Lock()
        self.stats: dict[str, int] = {"calls": 0, **dict.fromkeys(FAILURE_KINDS, 0)}

    # -- public API --------------------------------------------------------

    def score(
        self,
        prompt: str,
        completion: str,
        prompt_ids: list[int] | None = None,
        completion_ids: list[int] | None = None,
        row: Mapping[str, Any] | None = None,
    ) -> RewardOutcome:
        """Blocking call; safe from any thread (not from inside a running event loop)."""
        args = (prompt, completion, list(prompt_ids or []), list(completion_ids or []), row or {})
        if self._pool is not None:
            fut = self._schedule(args)
            return self._record(self._outcome_of(fut, None))
        if self.is_async:
            fut = self._threads.submit(asyncio.run, self._acall_inline(*args))
        else:
            fut = self._threads.submit(self._call_inline, *args)
        return self._record(self._outcome_of(fut, self.timeout_s))

    async def ascore(
        self,
        prompt: str,
        completion: str,
        prompt_ids: list[int] | None = None,
        completion_ids: list[int] | None = None,
        row: Mapping[str, Any] | None = None,
    ) -> RewardOutcome:
        """Awaitable call: the event loop is never blocked by the reward."""
        args = (prompt, completion, list(prompt_ids or []), list(completion_ids or []), row or {})
        if self._pool is not None:
            fut = self._schedule(args)
            await asyncio.wait({asyncio.wrap_future(fut)})  # never raises; classified below
            return self._record(self._outcome_of(fut, None))
        if self.is_async:
            task = asyncio.ensure_future(self._acall_inline(*args))
        else:
            task = asyncio.wrap_future(self._threads.submit(self._call_inline, *args))
        try:
            reward, scores = await asyncio.wait_for(task, self.timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            return self._record(self._timeout())
        except Exception as exc:  # noqa: BLE001 - a failing reward is an outcome, not a crash
            return self._record(_exception(exc))
        return self._record(RewardOutcome(reward, scores))

    def _schedule(self, args: tuple[Any, ...]) -> concurrent.futures.Future:
        """One call in the process pool; pebble kills it after `timeout_s`."""
        return self._pool.schedule(_call_in_worker, args=(self.fn, *args), timeout=self.timeout_s)

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

    def _call_inline(self, *args: Any) -> tuple[float, dict[str, float]]:
        return normalize_result(call_reward(self.fn, *args))

    async def _acall_inline(self, *args: Any) -> tuple[float, dict[str, float]]:
        value = call_reward(self.fn, *args)
        if inspect.isawaitable(value):
            value = await value
        return normalize_result(value)

    def _outcome_of(self, fut: concurrent.futures.Future, timeout: float | None) -> RewardOutcome:
        from pebble import ProcessExpired

        try:
            reward, scores = fut.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            # pebble's own timeout or ours: both surface as TimeoutError
            return self._timeout()
        except ProcessExpired as exc:
            return RewardOutcome(
                None,
                error="crash",
                detail=f"reward worker died: {exc} (exit code {getattr(exc, 'exitcode', None)})",
            )
        except Exception as exc:  # noqa: BLE001 - see ascore
            return _exception(exc)
        return RewardOutcome(reward, scores)

    def _timeout(self) -> RewardOutcome:
        return RewardOutcome(None, error="timeout", detail=f"reward exceeded {self.timeout_s} s")

    def _record(self, outcome: RewardOutcome) -> RewardOutcome:
        with self._lock:
            self.stats["calls"] += 1
            if outcome.error is not None:
                self.stats[outcome.error] += 1
        return outcome


def _exception(exc: BaseException) -> RewardOutcome:
    return RewardOutcome(None, error="exception", detail=f"{type(exc).__name__}: {exc}")
