"""One builder per role: `build_x(cfg) -> module`, from the resolved run config.

Builders take the whole (resolved) config and nothing else, so the same
function builds a module in this process (local mode) or inside a Ray actor
(Ray mode). Each module receives its typed schema section (`OmegaConf.to_object`
of a structured config is the dataclass) plus a small typed context with what
it needs from other sections: no module reads a plain dict with its own
defaults. Named components are picked from registries (`nexrl.registry`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from omegaconf import DictConfig, OmegaConf

from nexrl.config.derived import groups_per_batch, train_backend, weights_in_memory
from nexrl.protocols import (
    DataLoaderLike,
    ModuleLike,
    ProcessorLike,
    RolloutWorkerLike,
    TaskAdmissionLike,
    TrainBatchPoolLike,
    TrainWorkerLike,
    TrajectoryPoolLike,
    ValidatorLike,
    WeightSyncLike,
)
from nexrl.registry import Registry
from nexrl.types import NexRLRole

if TYPE_CHECKING:
    from nexrl.distributed.dp_train import RayDataParallelTrainClient
    from nexrl.inference.client import LLMServiceClient
    from nexrl.training.client import TrainServiceClient
    from nexrl.training.config import EngineConfig

ROLLOUT_WORKERS: Registry[Callable[..., RolloutWorkerLike]] = Registry(
    "rollout worker", "rollout_worker.type"
)
ROLLOUT_WORKERS.add("single_turn", "nexrl.rollout.workers:SingleTurnRolloutWorker")
ROLLOUT_WORKERS.add("simple", "nexrl.rollout.workers:SimpleRolloutWorker")
ROLLOUT_WORKERS.add("agent", "nexrl.rollout.agent:AgentRolloutWorker")

PROCESSORS: Registry[Callable[..., ProcessorLike]] = Registry(
    "algorithm processor", "algorithm.type"
)
PROCESSORS.add("grpo", "nexrl.algorithms.processor:GRPOProcessor")


def section(node: Any) -> Any:
    """The typed dataclass of a structured config section (a plain copy otherwise)."""
    if OmegaConf.is_config(node):
        return OmegaConf.to_object(node)
    return node


def inference_config(cfg: DictConfig) -> dict[str, Any]:
    """The inference section with its engine options merged in (the client's input)."""
    section = OmegaConf.to_container(cfg.service.inference_service, resolve=True)
    plain = cast(dict[str, Any], section)
    plain["model"] = plain.get("model") or cfg.model_path
    if plain.get("backend") == "vllm" and cfg.get("run_dir"):
        plain["run_dir"] = cfg.run_dir  # the managed server's log goes there
    return {**plain, **plain.pop("engine", {})}


def build_llm_client(cfg: DictConfig) -> LLMServiceClient:
    from nexrl.inference.client import LLMServiceClient

    return LLMServiceClient(inference_config(cfg))


def build_dataloader(cfg: DictConfig, is_validate: bool = False) -> DataLoaderLike:
    from nexrl.data import create_dataloader

    return create_dataloader(
        section(cfg.validate.data if is_validate else cfg.data), is_validate=is_validate
    )


def build_validate_dataloader(cfg: DictConfig) -> DataLoaderLike:
    return build_dataloader(cfg, is_validate=True)


def build_rollout_worker(cfg: DictConfig) -> RolloutWorkerLike:
    from nexrl.rewards import get_reward_fn
    from nexrl.rollout.base import RolloutContext

    config = section(cfg.rollout_worker)
    cls = ROLLOUT_WORKERS.get(config.type)
    context = RolloutContext.from_config(cfg, inflight_capable(cfg))
    client = build_llm_client(cfg)
    worker: RolloutWorkerLike
    if config.type == "simple":
        worker = cls(config, client, context)
    else:
        worker = cls(config, client, context, get_reward_fn(config.reward_fn))
    return worker


def build_trajectory_pool(cfg: DictConfig) -> TrajectoryPoolLike:
    from nexrl.pools import TrajectoryPool

    return TrajectoryPool(section(cfg.trajectory_pool))


def build_train_batch_pool(cfg: DictConfig) -> TrainBatchPoolLike:
    from nexrl.pools import TrainBatchPool

    return TrainBatchPool(section(cfg.train_batch_pool))


def build_algorithm_processor(cfg: DictConfig) -> ProcessorLike:
    from transformers import AutoTokenizer

    from nexrl.algorithms.processor import ProcessorContext

    config = section(cfg.algorithm)
    cls = PROCESSORS.get(config.type)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)  # type: ignore[no-untyped-call, unused-ignore]
    pad_id = tokenizer.pad_token_id or 0
    from nexrl.data.tasks import is_builtin_data, warn_own_data_defaults

    warn_own_data_defaults(cfg.data.path, cfg.rollout_worker.max_tokens)
    context = ProcessorContext(
        batch_size=cfg.trajectory_pool.batch_size,
        max_tokens=cfg.rollout_worker.max_tokens,
        pad_token_id=pad_id,
        warn_truncated=not is_builtin_data(cfg.data.path),
    )
    processor: ProcessorLike = cls(config, context)
    return processor


def engine_config(cfg: DictConfig) -> EngineConfig:
    """The train engine section, with `total_steps` defaulting to the run's step count
    and, in a local sync run on a CPU, `threads` to the process's torch threads: the
    engine and the trainer take turns there, so the update has every core. The trainer
    takes a GPU whenever there is one, and there it keeps the rule of `threads_for`
    (docs/training.md)."""
    engine: EngineConfig = section(cfg.train_worker.engine)
    engine.total_steps = engine.total_steps or cfg.train_worker.total_train_steps
    if engine.threads is None and cfg.launch_mode == "local" and cfg.weight.sync_mode == "sync":
        import torch

        if not torch.cuda.is_available():
            engine.threads = torch.get_num_threads()
    return engine


def build_train_worker(
    cfg: DictConfig, client: TrainServiceClient | RayDataParallelTrainClient | None = None
) -> TrainWorkerLike:
    """The train worker; `client` replaces the configured train service client (Ray's
    data-parallel worker group passes its own)."""
    from nexrl.training.client import TrainServiceClient
    from nexrl.training.train_worker import LossSpec, TrainWorker

    if client is None:
        client = TrainServiceClient(
            section(cfg.service.train_service), engine_config(cfg), cfg.model_path
        )
    return TrainWorker(
        section(cfg.train_worker),
        client,
        LossSpec.from_config(section(cfg.algorithm), cfg.weight.sync_mode),
        checkpoint_path=cfg.train_worker.checkpoint_path,
        sync_weight_path=cfg.train_worker.sync_weight_path,
        weights_in_memory=weights_in_memory(cfg),
        share_weights=shares_weights(cfg),
    )


def shares_weights(cfg: DictConfig) -> bool:
    """The engine takes the trainer's tensors as its weights instead of a copy: a local
    sync run with the trainer and an in-process engine in this process (no generation
    runs while the optimizer changes them; weights_in_memory says the engine is here)."""
    local = cfg.launch_mode == "local" and cfg.weight.sync_mode == "sync"
    return local and train_backend(cfg) == "builtin" and weights_in_memory(cfg)


def inflight_capable(cfg: DictConfig) -> bool:
    """The inference backend can swap weights under running requests (the built-in
    engine, in-process or behind `nexrl serve`; vLLM: pause with mode keep, load, resume)."""
    return cfg.service.inference_service.backend in ("builtin", "remote", "vllm")


def build_weight_sync_controller(cfg: DictConfig) -> WeightSyncLike:
    from nexrl.weight_sync import WeightSyncController

    backend = cfg.service.inference_service.backend
    capable = inflight_capable(cfg)
    if cfg.weight.inflight_weight_update and not capable:
        raise ValueError(
            f"weight.inflight_weight_update=true needs the built-in engine (backend builtin, "
            f"or remote to a `nexrl serve`) or vllm; service.inference_service.backend is "
            f"{backend!r}"
        )
    return WeightSyncController(
        section(cfg.weight),
        build_llm_client(cfg),
        cfg.train_worker.sync_weight_path,
        inflight_capable=capable,
        last_step=cfg.train_worker.total_train_steps or 0,
    )


def build_task_admission(cfg: DictConfig) -> TaskAdmissionLike:
    """The task owner: admission under the `weight.*` staleness policy, routing, re-queues."""
    from nexrl.rollout.admission import TaskAdmission
    from nexrl.rollout.sample_policy import SamplePolicy

    policy = SamplePolicy.from_config(
        section(cfg.weight), groups_per_batch(cfg), inflight_capable(cfg)
    )
    return TaskAdmission(policy, cfg.rollout_worker.max_task_retries)


def build_validator(cfg: DictConfig) -> ValidatorLike:
    from nexrl.validation import Validator

    return Validator(section(cfg.validate))


BUILDERS: dict[NexRLRole, Callable[[DictConfig], ModuleLike]] = {
    NexRLRole.DATA_LOADER: build_dataloader,
    NexRLRole.VALIDATE_DATALOADER: build_validate_dataloader,
    NexRLRole.ROLLOUT_WORKER: build_rollout_worker,
    NexRLRole.TRAJECTORY_POOL: build_trajectory_pool,
    NexRLRole.TRAIN_BATCH_POOL: build_train_batch_pool,
    NexRLRole.ALGORITHM_PROCESSOR: build_algorithm_processor,
    NexRLRole.TRAIN_WORKER: build_train_worker,
    NexRLRole.WEIGHT_SYNC_CONTROLLER: build_weight_sync_controller,
    NexRLRole.TASK_ADMISSION: build_task_admission,
    NexRLRole.VALIDATOR: build_validator,
}
