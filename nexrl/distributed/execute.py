"""The one way modules call each other.

Every cross-module call is `execute(ref.method, *args)`. In local mode `ref` is
the module object and the call is a plain call. In Ray mode `ref` is a
`RayActorWrapper` whose methods are Ray actor methods; `execute` notices the
`.remote` attribute and waits for the result. Calling code never knows which
mode it runs in, so local mode is the test bed for Ray mode.
"""

from __future__ import annotations

import os
from typing import Any

DEFAULT_TIMEOUT_S = float(os.environ.get("NEXRL_EXECUTE_TIMEOUT_S", "600"))


def is_remote(func: Any) -> bool:
    return callable(getattr(func, "remote", None))


def execute(func: Any, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
    """Call `func` and return its result, waiting on Ray if `func` is remote."""
    if is_remote(func):
        import ray

        ref = func.remote(*args, **kwargs)
        return ray.get(ref, timeout=timeout if timeout is not None else DEFAULT_TIMEOUT_S)
    return func(*args, **kwargs)


def execute_async(func: Any, *args: Any, **kwargs: Any) -> Any:
    """Start `func`: a Ray ObjectRef for remote methods, the result itself locally."""
    if is_remote(func):
        return func.remote(*args, **kwargs)
    return func(*args, **kwargs)


def resolve(value: Any, timeout: float | None = None) -> Any:
    """Wait for a value returned by `execute_async` (a no-op for local results)."""
    if type(value).__name__ == "ObjectRef":
        import ray

        return ray.get(value, timeout=timeout if timeout is not None else DEFAULT_TIMEOUT_S)
    return value
