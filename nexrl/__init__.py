"""nexrl: asynchronous RL post-training for LLMs (GRPO and its relatives).

The public names of seed 000 (the NexRL developer guide) and seed 004 (AReaL-lite)
are importable from here:

    from nexrl import NexRLController, BaseRolloutWorker, RolloutWorkflow, execute

They are loaded on first use (PEP 562), so `import nexrl` stays light; `dir(nexrl)`
lists them. `_EXPORTS` is the one table: a name maps to the module that defines it,
or to several modules tried in order (the first that imports wins), so a name whose
preferred module is not in this tree still resolves to the next one. Importing the
package registers the config schema with Hydra, so
`@hydra.main(config_path="pkg://nexrl.config", config_name="rl_train")` works.
"""

from __future__ import annotations

import importlib
from typing import Any

from nexrl.config.loader import register_schema
from nexrl.execute import execute as execute  # bound now: the submodule shares its name
from nexrl.execute import execute_async as execute_async

register_schema()

_AREAL = "nexrl.areal"  # AReaL-lite's API (seed 004)

_EXPORTS: dict[str, str | tuple[str, ...]] = {
    # seed 000: modules, controller, data flow
    "NexRLController": "nexrl.controller",
    "TrainingAborted": "nexrl.controller",
    "NexRLModule": "nexrl.module",
    "BaseRolloutWorker": "nexrl.rollout.base",
    "RolloutContext": "nexrl.rollout.base",
    "SimpleRolloutWorker": "nexrl.rollout.workers",
    "SingleTurnRolloutWorker": "nexrl.rollout.workers",
    "AgentRolloutWorker": "nexrl.rollout.agent",
    "BaseAlgorithmProcessor": "nexrl.algorithms.processor",
    "GRPOProcessor": "nexrl.algorithms.processor",
    "ProcessorContext": "nexrl.algorithms.processor",
    "collate": "nexrl.algorithms.processor",
    "TrajectoryPool": "nexrl.pools",
    "TrajectoryPoolInstance": "nexrl.pools",
    "SimpleTrajectoryStore": "nexrl.pools",
    "GroupedTrajectoryStore": "nexrl.pools",
    "HierarchicalTrajectoryStore": "nexrl.pools",
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
    "ErrorInfo": "nexrl.monitoring.errors",
    "RayResourceManager": "nexrl.distributed.resource_manager",
    "RayActorWrapper": "nexrl.distributed.resource_manager",
    "RayVirtualCluster": "nexrl.distributed.virtual_cluster",
    "RayWorkerGroup": "nexrl.distributed.worker_group",
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
    # seed 004: AReaL-lite's engines, workflows and tooling environments
    "RolloutWorkflow": "nexrl.rollout.workflow",
    "WorkflowExecutor": "nexrl.rollout.workflow",
    "ToolingEnv": "nexrl.envs",
    "LocalToolingEnv": "nexrl.envs",
    "MCPToolingEnv": "nexrl.envs",
    "InferenceEngine": _AREAL,
    "TrainEngine": _AREAL,
    "WeightUpdateMeta": _AREAL,
    "Actor": _AREAL,
    "Critic": _AREAL,
    "RolloutController": _AREAL,
    "TrainController": _AREAL,
    "DistributedBatch": _AREAL,
    "ToolExecutor": _AREAL,
    "MCPToolingEnvConfig": _AREAL,
    "GenerationHyperparameters": _AREAL,
    "SaveLoadMeta": _AREAL,
    "FinetuneSpec": _AREAL,
    "LLMRequest": _AREAL,
    "LLMResponse": _AREAL,
}

__all__ = sorted(_EXPORTS)


def _resolve(name: str) -> Any:
    """The exported object: the first module of its entry that imports and defines it."""
    sources = _EXPORTS[name]
    modules = (sources,) if isinstance(sources, str) else sources
    for path in modules:
        try:
            module = importlib.import_module(path)
        except ModuleNotFoundError as exc:
            if exc.name is None or not path.startswith(exc.name):
                raise  # the module exists but one of its own imports is missing
            continue
        if hasattr(module, name):
            return getattr(module, name)
    raise ImportError(
        f"nexrl.{name} is defined in {' or '.join(modules)}, which this installation "
        "does not provide"
    )


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'nexrl' has no attribute {name!r}")
    value = _resolve(name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
