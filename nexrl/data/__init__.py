"""Data loaders (training and validation) and built-in synthetic tasks.

`DATALOADER_REGISTRY` maps `data.type` to a loader class; `create_dataloader`
also accepts an import path "pkg.module:ClassName" for user loaders.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from nexrl.config.schema import DataConfig
from nexrl.data.base import BaseDataLoader, InMemoryDataLoader
from nexrl.data.hf import HFDataLoader, load_hf_dataset
from nexrl.data.tasks import TASK_WRITERS, shift_word, write_shift_task, write_task
from nexrl.registry import Registry, import_object

DATALOADER_REGISTRY: Registry[Callable[..., BaseDataLoader]] = Registry("data loader", "data.type")
DATALOADER_REGISTRY.add("hf", HFDataLoader)
DATALOADER_REGISTRY.add("torch", HFDataLoader)  # seed 000's name for the file-backed loader
DATALOADER_REGISTRY.add("memory", InMemoryDataLoader)
DATALOADER_REGISTRY.add("mock", InMemoryDataLoader)


def create_dataloader(
    config: DataConfig | Mapping[str, Any], is_validate: bool = False
) -> BaseDataLoader:
    """Build the loader named by `config.type` (a registered name or an import path)."""
    kind = config.type if isinstance(config, DataConfig) else str(config.get("type") or "hf")
    return DATALOADER_REGISTRY.get(kind)(config, is_validate=is_validate)


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
