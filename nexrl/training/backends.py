"""Train engines by name: `service.train_service.backend`.

`TRAIN_ENGINES` maps a name to an engine class called as `cls(engine_config,
model_path)` (`EngineConfig`, the model directory) that implements the train engine
interface of `TorchTrainEngine`. Entries are import paths, so this registry (read
by the config loader) imports no torch. `auto` is resolved by
`nexrl.config.derived.train_backend`, and `remote` is no engine here: the client
talks HTTP to a `nexrl train-service`.

    from nexrl.training.backends import TRAIN_ENGINES
    TRAIN_ENGINES.add("mine", MyEngine)   # service.train_service.backend=mine
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from nexrl.registry import Registry

if TYPE_CHECKING:
    from nexrl.training.config import EngineConfig
    from nexrl.training.protocol import TrainEngine

TRAIN_ENGINES: Registry[Callable[[EngineConfig, str], TrainEngine]] = Registry(
    "train backend", "service.train_service.backend"
)
TRAIN_ENGINES.add("builtin", "nexrl.training.torch_engine:TorchTrainEngine")
TRAIN_ENGINES.add("process", "nexrl.training.process_engine:ProcessTrainEngine")

REMOTE = "remote"
"""The backend with no engine in this process."""
