"""Named registries: config picks a component by name, never by if/elif.

One mechanism for every kind of named component (rollout workers, processors,
data loaders, rewards, advantage estimators, losses, KL estimators,
aggregation modes, inference and train backends, tool-call parsers, logger
backends). A registry is an explicit dict;
`get("pkg.module:attr")` also accepts an import path, the one escape hatch for
user code, resolved by `import_object`. Every failure names the kind, the
name, and the valid choices, in one format.

Entries may be registered lazily as import paths, so that a registry listing
the built-in workers does not import torch or the engine until one is chosen.

`check_kwargs` exists because algorithm functions are called with keyword
arguments straight from config: a misspelt key must fail loudly, naming the
key and the function, instead of being swallowed by a `**kwargs`.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class RegistryError(KeyError, ValueError):
    """An unknown name or a bad import path (a KeyError and a ValueError, for callers
    that catch either); `str()` is the plain message."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def import_object(path: str) -> Any:
    """Resolve "pkg.module:attr" to the object it names (the current folder is importable,
    so a user module next to the run works from the console script too)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise RegistryError(f"import path {path!r} must look like 'pkg.module:name'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RegistryError(f"import path {path!r}: cannot import {module_name!r} ({exc})") from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise RegistryError(f"import path {path!r}: module has no attribute {attr!r}") from exc


class Registry(Generic[T]):
    """A name -> object dict with one error format for unknown names (`T`: what every
    entry is: a class, a function of one signature)."""

    def __init__(self, kind: str, config_key: str | None = None) -> None:
        self.kind = kind
        self.config_key = config_key
        self._items: dict[str, T | str] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: `@REGISTRY.register("name")` above a function or class."""

        def deco(obj: T) -> T:
            self.add(name, obj)
            return obj

        return deco

    def add(self, name: str, obj: T | str) -> None:
        """Register `obj` (or an import path string "pkg.module:attr", resolved on use)."""
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._items[name] = obj

    def get(self, name: str) -> T:
        if name in self._items:
            item = self._items[name]
            if isinstance(item, str):  # lazy entry: what the import path names is a T
                loaded: T = import_object(item)
                self._items[name] = loaded
                return loaded
            return item
        if ":" in name:
            imported: T = import_object(name)  # a user's import path, trusted to be a T
            return imported
        raise self.unknown(name)

    def check(self, name: str) -> None:
        """Raise the `get` error for a name that is neither registered nor an import path,
        importing nothing (a lazy entry stays unimported)."""
        if name not in self._items and ":" not in name:
            raise self.unknown(name)

    def unknown(self, name: str) -> RegistryError:
        """The error for a name that is not registered: the config key, the kind, the name
        and the choices (in registration order)."""
        where = f"{self.config_key}: " if self.config_key else ""
        return RegistryError(
            f"{where}unknown {self.kind} {name!r}; valid choices: {', '.join(self._items)} "
            "or an import path 'package.module:name'"
        )

    def names(self) -> list[str]:
        return sorted(self._items)

    def __getitem__(self, name: str) -> T:
        """`get` of a registered name (no import path): `REGISTRY[name]`."""
        if name not in self._items:
            raise self.unknown(name)
        return self.get(name)

    def __iter__(self) -> Iterator[str]:
        """Registered names, in registration order (built-ins first)."""
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def registered_outside(self, package: str) -> list[str]:
        """Names whose entry comes from a module outside `package` (user code); a lazy
        entry is judged by its import path, without importing it."""

        def inside(item: object) -> bool:
            module = (
                item.split(":")[0]
                if isinstance(item, str)
                else getattr(item, "__module__", None) or ""
            )
            return module == package or module.startswith(f"{package}.")

        return sorted(n for n, item in self._items.items() if not inside(item))

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
