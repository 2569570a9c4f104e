"""Run configuration: the schema, the loader and the typed component options.

Names load on first use, so that `nexrl.config.options` (the engine's options,
imported by the engine and `nexrl serve`) does not import Hydra.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nexrl.config.loader import ConfigError, load_config
    from nexrl.config.schema import RLTrainConfig

__all__ = ["ConfigError", "RLTrainConfig", "load_config"]
_HOMES = {"ConfigError": "loader", "load_config": "loader", "RLTrainConfig": "schema"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"nexrl.config.{_HOMES[name]}"), name)
