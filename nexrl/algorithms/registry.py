"""Named registries: config picks a function by name, never by if/elif.

A registry is an explicit dict. `get("pkg.module:attr")` also accepts an
import path, the one escape hatch for user code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


class Registry:
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
