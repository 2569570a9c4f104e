"""The one way modules call each other.

Every cross-module call is `execute(ref.method, *args)`. In local mode `ref` is
the module object and the call is a plain call. In Ray mode `ref` is a
`RayActorWrapper` whose methods are Ray actor methods; `execute` notices the
`.remote` attribute and waits for the result. Calling code never knows which
mode it runs in, so local mode is the test bed for Ray mode.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_TIMEOUT_S = float(os.environ.get("NEXRL_EXECUTE_TIMEOUT_S", "600"))
"""Seconds `execute` / `resolve` wait on a Ray result when no `timeout` is given.
Set from `ray.execute_timeout_s` by the Ray system (and in every actor's environment)."""


REMOTE_CALLS: Counter[str] = Counter()
"""Ray calls this process made through `execute` / `execute_async`, by `module.method`
(`ModuleActor.call_counts` reads an actor's; benchmarks/bench_ray.py reports them)."""


def set_default_timeout(seconds: float) -> None:
    """Change this process's default wait for Ray results (`ray.execute_timeout_s`)."""
    global DEFAULT_TIMEOUT_S
    if seconds <= 0:
        raise ValueError(f"ray.execute_timeout_s must be > 0, got {seconds}")
    DEFAULT_TIMEOUT_S = float(seconds)


def default_timeout() -> float:
    """The current default wait for Ray results, in seconds."""
    return DEFAULT_TIMEOUT_S


class ModuleDiedError(RuntimeError):
    """The Ray actor behind a module is dead; the message names the module and method."""


def is_remote(func: object) -> bool:
    return callable(getattr(func, "remote", None))


def execute(func: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """Call `func` and return its result, waiting on Ray if `func` is remote.

    Typed by `func`'s own signature: a reference typed by its Protocol
    (nexrl/protocols.py) type-checks its calls, local and Ray alike (a Ray actor
    method answers what the module's method answers). Waits the default timeout;
    `execute_within` sets another."""
    return execute_within(None, func, *args, **kwargs)


def execute_within(
    timeout: float | None, func: Callable[P, R], *args: P.args, **kwargs: P.kwargs
) -> R:
    """`execute` with at most `timeout` seconds of waiting on Ray (None: the default)."""
    if is_remote(func):
        ref = func.remote(*args, **kwargs)  # type: ignore[attr-defined]
        name = _name(func)
        REMOTE_CALLS[name] += 1
        result: R = _get(ref, timeout, name)
        return result
    return func(*args, **kwargs)


def _name(func: object) -> str:
    return getattr(func, "__name__", None) or getattr(func, "_method_name", None) or repr(func)


def _get(ref: Any, timeout: float | None, name: str) -> Any:
    """`ray.get` with the default timeout; actor deaths and timeouts name the call."""
    import ray

    wait = timeout if timeout is not None else DEFAULT_TIMEOUT_S
    try:
        return ray.get(ref, timeout=wait)
    except ray.exceptions.RayActorError as exc:
        raise ModuleDiedError(f"{name}: the Ray actor running it died ({exc})") from exc
    except ray.exceptions.GetTimeoutError as exc:
        raise TimeoutError(f"{name}: no result within {wait:g} s (ray.execute_timeout_s)") from exc


def execute_async(func: Any, *args: Any, **kwargs: Any) -> Any:
    """Start `func`: a Ray ObjectRef for remote methods, the result itself locally."""
    if is_remote(func):
        REMOTE_CALLS[_name(func)] += 1
        return func.remote(*args, **kwargs)
    return func(*args, **kwargs)


def resolve(value: Any, timeout: float | None = None) -> Any:
    """Wait for a value returned by `execute_async` (a no-op for local results)."""
    if type(value).__name__ == "ObjectRef":
        return _get(value, timeout, "resolve")
    return value
