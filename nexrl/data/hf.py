"""`HFDataLoader`: tasks from a Hugging Face `datasets` table on disk.

Sources: a `.jsonl` / `.json` / `.parquet` / `.csv` file (`load_dataset`), a
directory written by `save_to_disk` (`load_from_disk`), or a directory of data
files (`load_dataset(dir)`). Rows are validated eagerly, so a bad dataset
fails at start with the file and row named, not mid-run in a worker thread.

Order and resume: instead of a torch DataLoader iterator, the loader keeps an
explicit `(epoch, position)` cursor into a permutation drawn from
`(seed, epoch)`. Tasks are handed out one at a time to several threads and can
be given back, which a batched iterator does not model; with the cursor the
whole state is two integers plus the returned-items queue, `state_dict()` /
`load_state_dict()` resume exactly, and epoch `e` has the same order in every
run with the same seed.

Config keys (defaults): `path` (required), `split` ("train"; used for saved
DatasetDicts and data directories, a single file is its own split),
`prompt_key` ("prompt"), `shuffle` (True for training, False for validation),
`seed` (0), `num_epochs` (None: training cycles forever; validation always
makes exactly one pass per `reset`), `max_items` (None: all rows; else the
first N rows of the file), `name` (None: the dataset's configuration, as
`datasets.load_dataset(path, name=...)`), `map_fn` (None: rows as stored; else
`package.module:function` mapping `(row, index)` to the new row).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from nexrl.config.schema import DataConfig, ValidateConfig
from nexrl.data.base import BaseDataLoader, json_number, json_object
from nexrl.types import JSONDict, JSONValue

if TYPE_CHECKING:
    from datasets import Dataset


def as_data_config(
    config: DataConfig | Mapping[str, object], is_validate: bool = False
) -> DataConfig:
    """The typed `data` section; a plain mapping must use its keys only, and what it leaves
    out takes the schema's default for `data` (or for `validate.data`)."""
    if isinstance(config, DataConfig):
        return config
    raw: dict[str, Any] = {k: v for k, v in dict(config).items() if v is not None}
    valid = set(DataConfig.__dataclass_fields__)
    unknown = sorted(set(raw) - valid)
    if unknown:
        raise ValueError(f"unknown data key(s) {unknown}; valid: {sorted(valid)}")
    base = ValidateConfig().data if is_validate else DataConfig()
    return dataclasses.replace(base, **raw)


READ_BLOCK = 64  # rows read from the table per query (`_block_rows`)
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class HFDataLoader(BaseDataLoader):
    """Rows of a `datasets.Dataset`, each returned with `index` (row) and `uid` (epoch, row)."""

    _block: list[JSONDict]  # rows read ahead (`_block_rows`)
    _block_start: int | None

    def __init__(
        self, config: DataConfig | Mapping[str, object], is_validate: bool = False
    ) -> None:
        config = as_data_config(config, is_validate)
        super().__init__(config, is_validate)
        if not config.path:
            raise ValueError("data.path: a dataset file or directory is required")
        self._path = str(config.path)
        self._prompt_key = config.prompt_key
        self._shuffle = config.shuffle
        self._seed = config.seed
        epochs = config.num_epochs
        self._num_epochs = 1 if is_validate else epochs
        if self._num_epochs is not None and self._num_epochs < 1:
            raise ValueError(f"data.num_epochs must be >= 1 or null, got {epochs!r}")
        ds = load_configured(config, is_validate)
        validate_rows(ds, self._prompt_key, self._path)
        self._dataset = ds
        self._blocks = ds.format["type"] is None  # a formatted table is read row by row
        self._set_epoch(0)

    # ---- order ------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return len(self._dataset)

    @property
    def epoch(self) -> int:
        return self._epoch

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self._shuffle:
            return np.arange(self.num_rows)
        return np.random.default_rng([self._seed, epoch]).permutation(self.num_rows)

    def _row(self, index: int, epoch: int, data: JSONDict | None = None) -> JSONDict:
        prefix = "val-" if self._is_validate else ""
        if data is None:
            data = self._dataset[int(index)]
        return {**data, "index": int(index), "uid": f"{prefix}{epoch}-{index}"}

    def _block_rows(self, pos: int) -> list[JSONDict]:
        """The rows at cursor positions [start, start + READ_BLOCK) of this epoch's order
        (start: `pos` rounded down), read in one table query: a query per row costs ~20 us
        of interpreter time on the path every rollout task takes."""
        start = pos - pos % READ_BLOCK
        if self._block_start != start:
            picked = [int(i) for i in self._order[start : start + READ_BLOCK]]
            columns = self._dataset[picked]
            rows = zip(*columns.values(), strict=True)
            self._block = [dict(zip(columns, values, strict=True)) for values in rows]
            self._block_start = start
        return self._block

    def _set_epoch(self, epoch: int, pos: int = 0) -> None:
        self._epoch, self._pos = epoch, pos
        self._order = self._permutation(epoch)
        self._block = []
        self._block_start: int | None = None

    # ---- BaseDataLoader hooks --------------------------------------------
    def __getitem__(self, index: int) -> JSONDict:
        if not 0 <= index < self.num_rows:
            raise IndexError(f"{self._path}: row {index} out of range [0, {self.num_rows})")
        with self._lock:
            return self._row(index, self._epoch)

    def _fresh_exhausted(self) -> bool:
        return self._num_epochs is not None and self._epoch >= self._num_epochs

    def _fresh_remaining(self) -> int:
        if self._num_epochs is None:
            return self.num_rows - self._pos
        return max(0, (self._num_epochs - self._epoch) * self.num_rows - self._pos)

    def _next_fresh(self) -> JSONDict | None:
        if self._fresh_exhausted():
            return None
        pos = self._pos
        data = self._block_rows(pos)[pos % READ_BLOCK] if self._blocks else None
        item = self._row(self._order[pos], self._epoch, data)
        self._pos += 1
        if self._pos == self.num_rows:
            self._set_epoch(self._epoch + 1)
        return item

    def _reset_fresh(self) -> None:
        self._set_epoch(0)

    # ---- checkpoint -------------------------------------------------------
    def state_dict(self) -> JSONDict:
        """JSON-serialisable state: cursor, returned items and a dataset fingerprint."""
        with self._lock:
            return {
                "epoch": self._epoch,
                "position": self._pos,
                "returned": self.returned_state(),
                "seed": self._seed,
                "shuffle": self._shuffle,
                "num_rows": self.num_rows,
            }

    def load_state_dict(self, state: Mapping[str, JSONValue]) -> None:
        """Restore a `state_dict()`; fails if the dataset size, seed or shuffle changed."""
        for key, mine in (("num_rows", self.num_rows), ("seed", self._seed)):
            if state.get(key) != mine:
                raise ValueError(
                    f"{self._path}: loader state has {key}={state.get(key)!r} but this "
                    f"loader has {key}={mine!r}; cannot resume exactly"
                )
        if state.get("shuffle", self._shuffle) != self._shuffle:
            raise ValueError(f"{self._path}: loader state was saved with a different shuffle")
        with self._lock:
            self._set_epoch(int(json_number(state["epoch"])), int(json_number(state["position"])))
            returned = state.get("returned", [])
            if not isinstance(returned, list):
                raise ValueError(f"{self._path}: loader state 'returned' must be a list")
            self._restore_returned([json_object(item, "returned") for item in returned])


def load_configured(config: DataConfig, is_validate: bool = False) -> Dataset:
    """The table a `data` section names: `path` (with its configuration `name`), its first
    `max_items` rows, each passed through `map_fn`."""
    section = "validate.data" if is_validate else "data"
    path = str(config.path)
    if config.name is not None:
        if Path(path).is_file():
            raise ValueError(
                f"{section}.name={config.name!r} picks a configuration of a Hub dataset or a "
                f"dataset folder, but {section}.path {path!r} is a file"
            )
        from nexrl.data.hub import load_dataset

        ds = load_dataset(path, config.name, config.split)
    else:
        ds = load_hf_dataset(path, config.split)
    if config.max_items is not None:
        ds = ds.select(range(min(config.max_items, len(ds))))
    if config.map_fn:
        from nexrl.data.hub import apply_map

        ds = apply_map(ds, config.map_fn, f"{section}.map_fn")
    return ds


def load_hf_dataset(path: str, split: str = "train") -> Dataset:
    """Load a `datasets.Dataset` from a file, a saved dataset directory or a data directory."""
    import datasets

    p = Path(path)
    if not p.exists():
        from nexrl.data.hub import is_hub_name, load_dataset

        if is_hub_name(path):  # `org/name`: the Hub, through the datasets cache
            return load_dataset(path, split=split)
        raise ValueError(f"data.path {path!r} does not exist")
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        if p.is_file():
            builder = FILE_BUILDERS.get(p.suffix.lower())
            if builder is None:
                raise ValueError(
                    f"data.path {path!r}: unsupported file type {p.suffix!r}; "
                    f"use one of {', '.join(FILE_BUILDERS)} or a saved dataset directory"
                )
            try:
                return datasets.load_dataset(builder, data_files=str(p), split="train")
            except Exception as exc:
                raise ValueError(_load_error(p, exc)) from exc
        if any((p / f).exists() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
            ds = datasets.load_from_disk(str(p))
        else:
            ds = datasets.load_dataset(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"data.split {split!r} not in {path!r}; splits: {list(ds)}")
            ds = ds[split]
        return ds
    finally:
        if bars:
            datasets.enable_progress_bars()


def _load_error(path: Path, exc: Exception) -> str:
    """Name the first unparsable line of a JSON-lines file, else repeat the loader's error."""
    if path.suffix.lower() == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    json.loads(line)
                except json.JSONDecodeError as err:
                    return f"{path}: row {i} (line {i + 1}) is not valid JSON: {err}"
    return f"{path}: cannot load dataset: {exc}"


def validate_rows(ds: Dataset, prompt_key: str, path: str) -> None:
    """Every row must have `prompt_key`: a non-empty str or a list of chat-message dicts."""
    if len(ds) == 0:
        raise ValueError(f"{path}: dataset has no rows")
    if prompt_key not in ds.column_names:
        raise ValueError(
            f"{path}: row 0: missing key {prompt_key!r} (data.prompt_key); "
            f"columns: {ds.column_names}"
        )
    for i, value in enumerate(ds[prompt_key]):
        if value is None:
            raise ValueError(f"{path}: row {i}: missing key {prompt_key!r}")
        if isinstance(value, str):
            if not value:
                raise ValueError(f"{path}: row {i}: {prompt_key!r} is an empty string")
        elif not (isinstance(value, list) and all(isinstance(m, dict) for m in value)):
            raise ValueError(
                f"{path}: row {i}: {prompt_key!r} must be a str or a list of chat messages, "
                f"got {type(value).__name__}: {value!r:.80}"
            )
