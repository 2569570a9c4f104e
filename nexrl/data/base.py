"""`BaseDataLoader`: a thread-safe task source with a queue of returned items.

Several rollout worker threads pull tasks concurrently, and a task whose
rollout must be redone (weight sync in progress, a failed rollout) is given
back with `add_item_front` / `add_item_back`. Given-back items go to a
"returned" queue that is always served before fresh data, so no task is lost
even when the fresh stream is infinite (a training loader cycling epochs):
"back" means the end of the returned queue, not the end of the dataset.

Subclasses supply the fresh stream through three hooks (`_next_fresh`,
`_fresh_remaining`, `_reset_fresh`); all locking lives here.

The queue holds `Task`s only: a row given back as a dict becomes a Task (a Task
reads like its row: `item["prompt"]`, `item.get(...)`).

A loader written to seed 000's contract overrides `get_next_item`, `is_finished`,
`__len__` and `reset` itself and keeps the inherited `add_item_*`. Its overrides are
wrapped (`__init_subclass__`) so that tasks given back are still served first and
counted: the run's retries never vanish into a queue the subclass never reads.
A subclass that overrides `add_item_front` too owns its queue, and is left alone.
"""

from __future__ import annotations

import copy
import functools
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeAlias, TypeVar

from omegaconf import OmegaConf

from nexrl.module import NexRLModule
from nexrl.types import JSONDict, JSONValue, Task

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from nexrl.config.schema import DataConfig

LoaderConfig: TypeAlias = "DataConfig | DictConfig | Mapping[str, object]"
"""A loader's `data` section: the typed one, its DictConfig, or a plain mapping (tests)."""
_R = TypeVar("_R")


def item_to_state(item: JSONDict | Task) -> JSONDict:
    """A queued row or `Task` as JSON for a checkpoint.

    A Task keeps the bookkeeping that survives a restart (retries, aborts, tail);
    its id is per process and its partial samples belong to weights that the
    resumed run no longer serves, so both are dropped (the task regenerates).
    """
    if not isinstance(item, Task):
        return {"row": copy.deepcopy(dict(item))}
    return {
        "row": copy.deepcopy(item.data),
        "task": {"retries": item.retries, "aborts": item.aborts, "tail": item.tail},
        "is_validate": item.is_validate,
    }


def item_from_state(state: Mapping[str, JSONValue]) -> JSONDict | Task:
    """The inverse of `item_to_state` (a bare row dict from older checkpoints is kept)."""
    if "row" not in state:
        return dict(state)
    row = json_object(state["row"], "row")
    if "task" not in state:
        return row
    book = json_object(state["task"], "task")
    return Task(
        data=row,
        is_validate=bool(state.get("is_validate", False)),
        retries=int(json_number(book.get("retries", 0))),
        aborts=int(json_number(book.get("aborts", 0))),
        tail=bool(book.get("tail", False)),
    )


def json_object(value: JSONValue, key: str) -> JSONDict:
    if not isinstance(value, dict):
        raise ValueError(f"loader state: {key!r} of a returned item must be a JSON object")
    return dict(value)


def json_number(value: JSONValue) -> float | int | str:
    if not isinstance(value, int | float | str):
        raise ValueError(f"loader state: expected a number, got {value!r}")
    return value


def _queue(loader: BaseDataLoader) -> deque[Task]:
    """The loader's given-back queue (made here when a subclass skipped `__init__`)."""
    if "_returned" not in loader.__dict__:
        loader._lock = threading.RLock()
        loader._returned = deque()
    return loader._returned


def _served_first(
    get_next: Callable[[BaseDataLoader], _R],
) -> Callable[[BaseDataLoader], _R | Task]:
    @functools.wraps(get_next)
    def get_next_item(self: BaseDataLoader) -> _R | Task:
        queue = _queue(self)
        with self._lock:
            if queue:
                return queue.popleft()
        return get_next(self)

    return get_next_item


def _finished_when_empty(
    finished: Callable[[BaseDataLoader], bool],
) -> Callable[[BaseDataLoader], bool]:
    @functools.wraps(finished)
    def is_finished(self: BaseDataLoader) -> bool:
        return not _queue(self) and finished(self)

    return is_finished


def _counted(length: Callable[[BaseDataLoader], int]) -> Callable[[BaseDataLoader], int]:
    @functools.wraps(length)
    def __len__(self: BaseDataLoader) -> int:
        return len(_queue(self)) + length(self)

    return __len__


def _cleared(reset: Callable[[BaseDataLoader], None]) -> Callable[[BaseDataLoader], None]:
    @functools.wraps(reset)
    def do_reset(self: BaseDataLoader) -> None:
        _queue(self).clear()
        reset(self)

    return do_reset


def _wrap(cls: type[BaseDataLoader], name: str) -> Callable[[BaseDataLoader], object] | None:
    """`cls`'s own `name` method wrapped to serve / count the given-back queue, if it has one."""
    own = cls.__dict__.get(name)
    if own is None:
        return None
    if name == "get_next_item":
        return _served_first(own)
    if name == "is_finished":
        return _finished_when_empty(own)
    return _counted(own) if name == "__len__" else _cleared(own)


class BaseDataLoader(NexRLModule):
    """Serves tasks: returned items first, then the subclass's fresh stream."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        """A seed-000 loader's own `get_next_item` / `is_finished` / `__len__` / `reset`
        still serve and count the given-back queue (see the module docstring)."""
        super().__init_subclass__(**kwargs)
        if "add_item_front" in cls.__dict__:
            return  # the subclass keeps its own queue
        for name in ("get_next_item", "is_finished", "__len__", "reset"):
            wrapped = _wrap(cls, name)
            if wrapped is not None:
                setattr(cls, name, wrapped)

    def __init__(self, config: LoaderConfig | None = None, is_validate: bool = False) -> None:
        super().__init__()
        self._config: LoaderConfig = config if config is not None else {}
        self._is_validate = is_validate
        self._lock = threading.RLock()
        self._returned: deque[Task] = deque()

    # ---- hooks for subclasses (called with the lock held) -----------------
    def _next_fresh(self) -> JSONDict | None:
        """Next fresh item, or None when the fresh stream is exhausted."""
        raise NotImplementedError

    def _fresh_remaining(self) -> int:
        """Fresh items left (for an endless stream: left in the current epoch)."""
        raise NotImplementedError

    def _fresh_exhausted(self) -> bool:
        return self._fresh_remaining() == 0

    def _reset_fresh(self) -> None:
        raise NotImplementedError

    # ---- public API -------------------------------------------------------
    @property
    def is_validate(self) -> bool:
        return self._is_validate

    def __len__(self) -> int:
        """Items left: returned items plus fresh ones (see `_fresh_remaining`)."""
        with self._lock:
            return len(self._returned) + self._fresh_remaining()

    def __getitem__(self, index: int) -> JSONDict:
        raise NotImplementedError(f"{type(self).__name__} does not support indexing")

    def get_next_item(self) -> JSONDict | Task | None:
        """The next task (a returned one first), or None if nothing is left."""
        with self._lock:
            if self._returned:
                return self._returned.popleft()
            return self._next_fresh()

    def is_finished(self) -> bool:
        """True when no returned item is queued and the fresh stream is exhausted."""
        with self._lock:
            return not self._returned and self._fresh_exhausted()

    def can_return_item(self) -> bool:
        """True when `get_next_item` would return an item right now."""
        return not self.is_finished()

    def reset(self) -> None:
        """Back to the initial state: returned items dropped, fresh stream rewound."""
        with self._lock:
            self._returned.clear()
            self._reset_fresh()

    def add_item(self, item: JSONDict | Task) -> None:
        """Same as `add_item_back`."""
        self.add_item_back(item)

    def add_item_front(self, item: JSONDict | Task) -> None:
        """Give an item back; it is served next."""
        task = self._as_task(item)
        with self._lock:
            _queue(self).appendleft(task)

    def add_item_back(self, item: JSONDict | Task) -> None:
        """Give an item back; it is served after the other returned items, before fresh data."""
        task = self._as_task(item)
        with self._lock:
            _queue(self).append(task)

    def _as_task(self, item: JSONDict | Task) -> Task:
        if isinstance(item, Task):
            return item
        return Task(data=dict(item), is_validate=getattr(self, "_is_validate", False))

    def returned_items(self) -> list[Task]:
        """A copy of the queued returned items (front first)."""
        with self._lock:
            return copy.deepcopy(list(_queue(self)))

    def returned_state(self) -> list[JSONValue]:
        """The queued returned items as JSON (`item_to_state`), for checkpoints: a re-queued
        `Task` must survive `json.dumps`."""
        with self._lock:
            return [item_to_state(item) for item in _queue(self)]

    def _restore_returned(self, items: list[Mapping[str, JSONValue]]) -> None:
        with self._lock:
            self._returned = deque(map(self._as_task, map(item_from_state, items)))


def _rows_of(rows: object) -> list[Mapping[str, JSONValue]]:
    """`data.items` as rows: a list of mappings (a clear error names anything else)."""
    if not isinstance(rows, list | tuple) or not all(isinstance(r, Mapping) for r in rows):
        raise ValueError(f"data.items must be a list of row mappings, got {rows!r:.80}")
    return list(rows)


class InMemoryDataLoader(BaseDataLoader):
    """A loader over a list of dicts (config key `items`), one pass per `reset`.

    For tests and small programmatic tasks; rows get `index` and `uid` like the
    HF loader's (uid = "<index>" since there is one epoch). Built from the `data`
    section (`data.type=memory` or `mock`, which has no `items`), it holds the rows
    of `data.path` (the built-in task's file when no path is set) in memory.
    """

    def __init__(
        self,
        config: LoaderConfig | None = None,
        is_validate: bool = False,
        items: list[JSONDict] | None = None,
    ) -> None:
        super().__init__(config, is_validate)
        rows = items if items is not None else self._config_rows()
        self._rows: list[JSONDict] = [dict(r) for r in rows]
        self._pos = 0

    def _config_rows(self) -> Sequence[Mapping[str, JSONValue]]:
        config = self._config
        if isinstance(config, Mapping):  # a DictConfig is a Mapping too
            rows = config.get("items", None)
            path = config.get("path", None)
        else:  # the typed `data` section
            rows, path = getattr(config, "items", None), getattr(config, "path", None)
        if OmegaConf.is_config(rows):
            rows = OmegaConf.to_container(rows, resolve=True)
        if rows or path is None:
            return _rows_of(rows or [])
        from nexrl.config.schema import DataConfig
        from nexrl.data.hf import load_configured, load_hf_dataset

        if isinstance(config, DataConfig):  # its `name`, `max_items` and `map_fn` apply
            return list(load_configured(config, self._is_validate))

        split = getattr(config, "split", None) or "train"
        return list(load_hf_dataset(str(path), split))

    def __getitem__(self, index: int) -> JSONDict:
        return {**self._rows[index], "index": index, "uid": f"0-{index}"}

    def _next_fresh(self) -> JSONDict | None:
        if self._pos >= len(self._rows):
            return None
        self._pos += 1
        return self[self._pos - 1]

    def _fresh_remaining(self) -> int:
        return len(self._rows) - self._pos

    def _reset_fresh(self) -> None:
        self._pos = 0

    def state_dict(self) -> JSONDict:
        """JSON-serialisable state: position, returned items and the row count."""
        with self._lock:
            return {
                "position": self._pos,
                "returned": self.returned_state(),
                "num_rows": len(self._rows),
            }

    def load_state_dict(self, state: Mapping[str, JSONValue]) -> None:
        """Restore a `state_dict()`; fails if the number of rows changed."""
        if state.get("num_rows") != len(self._rows):
            raise ValueError(
                f"loader state has num_rows={state.get('num_rows')!r} but this loader has "
                f"{len(self._rows)} rows; cannot resume exactly"
            )
        with self._lock:
            self._pos = int(json_number(state["position"]))
            returned = state.get("returned", [])
            if not isinstance(returned, list):
                raise ValueError("loader state: 'returned' must be a list")
            self._restore_returned([json_object(item, "returned") for item in returned])
