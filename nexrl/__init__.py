"""nexrl: asynchronous RL post-training for LLMs (GRPO and its relatives).

The names of seed 000 (the NexRL developer guide) are importable from here:

    from nexrl import NexRLController, BaseRolloutWorker, BaseAlgorithmProcessor

They are loaded on first use (PEP 562), so `import nexrl` stays light. Importing
the package registers the config schema with Hydra, so
`@hydra.main(config_path="pkg://nexrl.config", config_name="rl_train")` works.
"""

from __future__ import annotations

import importlib
from typing import Any

from nexrl.config.loader import register_schema

register_schema()

_EXPORTS = {
    "NexRLController": "nexrl.controller",
    "TrainingAborted": "nexrl.controller",
    "NexRLModule": "nexrl.module",
    "BaseRolloutWorker": "nexrl.rollout.base",
    "RolloutContext": "nexrl.rollout.base",
    "SimpleRolloutWorker": "nexrl.rollout.workers",
    "SingleTurnRolloutWorker": "nexrl.rollout.workers",
    "BaseAlgorithmProcessor": "nexrl.algorithms.processor",
    "GRPOProcessor": "nexrl.algorithms.processor",
    "ProcessorContext": "nexrl.algorithms.processor",
    "collate": "nexrl.algorithms.processor",
    "TrajectoryPool": "nexrl.pools",
    "TrainBatchPool": "nexrl.pools",
    "BaseDataLoader": "nexrl.data",
    "HFDataLoader": "nexrl.data",
    "InMemoryDataLoader": "nexrl.data",
    "LLMServiceClient": "nexrl.inference.client",
    "TrainServiceClient": "nexrl.training.client",
    "TrainWorker": "nexrl.training.train_worker",
    "WeightSyncController": "nexrl.weight_sync",
    "Validator": "nexrl.validation",
    "ActivityTracker": "nexrl.monitoring",
    "ActivityTrackerProxy": "nexrl.monitoring",
    "ErrorReporter": "nexrl.monitoring.errors",
    "ErrorSeverity": "nexrl.monitoring.errors",
    "Batch": "nexrl.types",
    "Trajectory": "nexrl.types",
    "Task": "nexrl.types",
    "StepResult": "nexrl.types",
    "NexRLRole": "nexrl.types",
    "ModelTag": "nexrl.types",
    "execute": "nexrl.execute",
    "execute_async": "nexrl.execute",
    "load_config": "nexrl.config",
    "Registry": "nexrl.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'nexrl' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
