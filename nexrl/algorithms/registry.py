"""Named registries: config picks a function by name, never by if/elif.

A registry is an explicit dict. `get("pkg.module:attr")` also accepts an
import path, the one escape hatch for user code.

`check_kwargs` exists because every algorithm function is called with keyword
arguments straight from config: a misspelt key must fail loudly, naming the
key and the function, instead of being swallowed by a `**kwargs`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any


class Registry:
    """A name -> function dict with a helpful error for unknown names."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, Callable[..., Any]] = {}

    def register(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = fn
            return fn

        return deco

    def get(self, name: str) -> Callable[..., Any]:
        if name in self._items:
            return self._items[name]
        if ":" in name:
            module, attr = name.split(":", 1)
            return getattr(importlib.import_module(module), attr)
        raise KeyError(
            f"unknown {self.kind} {name!r}; choose one of {sorted(self._items)} "
            "or give an import path 'package.module:function'"
        )

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items


def check_kwargs(
    fn: Callable[..., Any],
    kwargs: Mapping[str, Any],
    what: str,
    positional: Iterable[str] = (),
) -> None:
    """Raise TypeError naming `what` and every key of `kwargs` that `fn` does not accept.

    `positional` lists the parameters the caller fills itself (e.g. `logprobs`,
    `batch`); they are not valid config keys. A function with `**kwargs`
    accepts everything (user code may want that).
    """
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    skip = set(positional)
    accepted = [
        n
        for n, p in params.items()
        if n not in skip
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    bad = sorted(set(kwargs) - set(accepted))
    if bad:
        raise TypeError(
            f"{what} got unexpected keyword argument(s) {bad}; it accepts {sorted(accepted)}"
        )
