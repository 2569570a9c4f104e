"""AReaL-lite's API (seed 004) as thin layers over nexrl.

    from nexrl.areal import InferenceEngine, Actor, Critic, LLMRequest, WeightUpdateMeta

Engines, workflows, tools, datasets and configs keep the seed's names and
signatures; the work is done by nexrl's own engine, executor, torch trainer,
tool environments and loaders. docs/areal_api.md maps each name to what it
wraps and lists where the seed's text had to change.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "InferenceEngine": "nexrl.areal.engine",
    "WeightUpdateFuture": "nexrl.areal.engine",
    "TrainEngine": "nexrl.areal.train",
    "Actor": "nexrl.areal.train",
    "Critic": "nexrl.areal.train",
    "RolloutController": "nexrl.areal.controller",
    "TrainController": "nexrl.areal.controller",
    "LocalScheduler": "nexrl.areal.controller",
    "RolloutWorkflow": "nexrl.areal.workflow",
    "DistributedBatch": "nexrl.areal.workflow",
    "LLMRequest": "nexrl.areal.types",
    "LLMResponse": "nexrl.areal.types",
    "GenerationHyperparameters": "nexrl.areal.types",
    "WeightUpdateMeta": "nexrl.areal.types",
    "SaveLoadMeta": "nexrl.areal.types",
    "FinetuneSpec": "nexrl.areal.types",
    "AllocationMode": "nexrl.areal.types",
    "ToolExecutor": "nexrl.areal.tooling",
    "LocalToolingEnv": "nexrl.areal.tooling",
    "ToolingEnv": "nexrl.areal.tooling",
    "MCPToolingEnvConfig": "nexrl.areal.tooling",
    "load_expr_config": "nexrl.areal.config",
    "load_dataset": "nexrl.data.hub",
    "split_dataset_by_node": "nexrl.data.hub",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name == "MCPToolingEnv":  # the `mcp` SDK is an optional extra
        from nexrl.envs.mcp_env import MCPToolingEnv

        return MCPToolingEnv
    if name not in _EXPORTS:
        raise AttributeError(f"module 'nexrl.areal' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
