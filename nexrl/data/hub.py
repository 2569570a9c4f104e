"""Datasets by Hub name, per-rank shards and a `map` hook (seed 004's dataset section).

`load_dataset(path, name, split, data_files)` takes what seed 004 passes to
`datasets.load_dataset`: a Hub name (`openai/gsm8k`), a local file or folder.
A Hub name goes to `datasets.load_dataset`, which reads the datasets cache
first; with `HF_DATASETS_OFFLINE=1` (or `HF_HUB_OFFLINE=1`) it only reads
the cache, and a dataset missing from it fails with one line saying so. A local
path without `name` / `data_files` loads as nexrl's loader does
(`hf.load_hf_dataset`: a file, a `save_to_disk` folder, a data folder).

`split_dataset_by_node` is `datasets.distributed.split_dataset_by_node`
(rank `rank` of `world_size` gets the rank-th contiguous 1/world_size of the
rows); `apply_map` runs a row function `fn(example, idx) -> example` over the table with
`with_indices=True`, the seed's `process_example`. `prepare_dataset` chains the
three: what the training loader needs from one config.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

from nexrl.data.hf import load_hf_dataset
from nexrl.types import JSONDict

if TYPE_CHECKING:
    from datasets import Dataset

DataFiles: TypeAlias = "str | list[str] | dict[str, str] | dict[str, list[str]] | None"
MapFn: TypeAlias = "Callable[[JSONDict, int], JSONDict]"
"""`map_fn(example, idx)`: the new row."""

__all__ = [
    "apply_map",
    "import_fn",
    "is_hub_name",
    "load_dataset",
    "prepare_dataset",
    "split_dataset_by_node",
]


_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.\-]*/[A-Za-z0-9][\w.\-]*$")


def is_hub_name(path: str) -> bool:
    """`org/name` that is not a local path: a Hugging Face Hub dataset id."""
    return bool(_HUB_NAME.match(path)) and not Path(path).exists()


def _offline() -> bool:
    flags = (os.environ.get(k, "") for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))
    return any(f.strip().lower() in ("1", "true", "yes", "on") for f in flags)


def load_dataset(
    path: str,
    name: str | None = None,
    split: str = "train",
    data_files: DataFiles = None,
) -> Dataset:
    """One split of a dataset named by Hub id or local path, as a `datasets.Dataset`."""
    import datasets

    if Path(path).exists() and name is None and data_files is None:
        return load_hf_dataset(path, split)
    try:
        return datasets.load_dataset(path, name=name, split=split, data_files=data_files)
    except (ConnectionError, FileNotFoundError, ValueError) as exc:
        where = "the datasets cache (offline mode)" if _offline() else "the Hub or the cache"
        raise ValueError(
            f"data.path {path!r} (data.name={name!r}, split={split!r}) could not be loaded from "
            f"{where}: {str(exc).splitlines()[0]}"
        ) from exc


def split_dataset_by_node(dataset: Dataset, rank: int, world_size: int) -> Dataset:
    """Rank `rank`'s share of `dataset` (the `datasets` library's own split)."""
    from datasets.distributed import split_dataset_by_node as split

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    return split(dataset, rank=rank, world_size=world_size)


def import_fn(spec: str) -> Callable[..., object]:
    """`package.module:function` as the function (a clear error names the spec)."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{spec!r} must be an import path `package.module:function`")
    fn = getattr(importlib.import_module(module), attr, None)
    if not callable(fn):
        raise ValueError(f"{spec!r}: {module} has no function {attr!r}")
    return fn


def apply_map(dataset: Dataset, fn: MapFn | str, key: str = "map_fn") -> Dataset:
    """`dataset.map(fn, with_indices=True)`: `fn(example, idx)` returns the new row. An
    error in `fn` is re-raised naming `key` (the config key) and the row's index."""
    if isinstance(fn, str):
        try:
            func: Callable[..., object] = import_fn(fn)
        except (ImportError, ValueError) as exc:
            raise ValueError(f"{key}: {exc}") from exc
    else:
        func = fn
    label = fn if isinstance(fn, str) else getattr(fn, "__name__", repr(fn))

    def row_fn(example: JSONDict, idx: int) -> object:
        try:
            return func(example, idx)
        except Exception as exc:
            raise ValueError(f"{key} {label!r} failed on row {idx}: {exc!r}") from exc

    return dataset.map(row_fn, with_indices=True)


def prepare_dataset(
    path: str,
    name: str | None = None,
    split: str = "train",
    data_files: DataFiles = None,
    map_fn: MapFn | str | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> Dataset:
    """Load, preprocess with `map_fn`, then keep rank `rank`'s share."""
    ds = load_dataset(path, name, split, data_files)
    if map_fn is not None:
        ds = apply_map(ds, map_fn)
    if world_size > 1:
        ds = split_dataset_by_node(ds, rank, world_size)
    return ds
