"""Data loaders (training and validation) and built-in synthetic tasks.

`DATALOADER_REGISTRY` maps `data.type` to a loader class; `create_dataloader`
also accepts an import path "pkg.module:ClassName" for user loaders.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from nexrl.data.base import BaseDataLoader, InMemoryDataLoader
from nexrl.data.hf import HFDataLoader, load_hf_dataset
from nexrl.data.tasks import TASK_WRITERS, shift_word, write_shift_task, write_task

DATALOADER_REGISTRY: dict[str, type[BaseDataLoader]] = {
    "hf": HFDataLoader,
    "torch": HFDataLoader,  # seed 000's name for the file-backed loader
    "memory": InMemoryDataLoader,
    "mock": InMemoryDataLoader,
}


def import_object(path: str) -> Any:
    """Resolve "pkg.module:attr" to the object it names."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"import path {path!r} must look like 'pkg.module:name'")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise ValueError(f"import path {path!r}: module has no attribute {attr!r}") from exc


def create_dataloader(config: Mapping[str, Any], is_validate: bool = False) -> BaseDataLoader:
    """Build the loader named by `config.type` (default "hf") or an import path."""
    kind = str(config.get("type", None) or "hf")
    if kind in DATALOADER_REGISTRY:
        cls = DATALOADER_REGISTRY[kind]
    elif ":" in kind:
        cls = import_object(kind)
    else:
        raise ValueError(
            f"data.type: unknown loader {kind!r}; valid choices: "
            f"{', '.join(DATALOADER_REGISTRY)} or 'pkg.module:ClassName'"
        )
    return cls(config, is_validate=is_validate)


__all__ = [
    "DATALOADER_REGISTRY",
    "TASK_WRITERS",
    "BaseDataLoader",
    "HFDataLoader",
    "InMemoryDataLoader",
    "create_dataloader",
    "import_object",
    "load_hf_dataset",
    "shift_word",
    "write_shift_task",
    "write_task",
]
