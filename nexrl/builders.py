"""One builder per role: `build_x(config) -> module`, from the resolved run config.

Builders take the whole (resolved) config and nothing else, so the same
function builds a module in this process (local mode) or inside a Ray actor
(Ray mode). Module classes themselves take their dependencies explicitly,
which keeps them easy to test.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf

from nexrl.types import NexRLRole


def import_path(path: str) -> Any:
    module, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"expected 'package.module:Name', got {path!r}")
    return getattr(importlib.import_module(module), attr)


def _plain(section: Any) -> dict[str, Any]:
    return (
        OmegaConf.to_container(section, resolve=True)
        if isinstance(section, DictConfig)
        else dict(section)
    )


def inference_config(cfg: DictConfig) -> dict[str, Any]:
    section = _plain(cfg.service.inference_service)
    section["model"] = section.get("model") or cfg.model_path
    return {**section, **section.pop("engine", {})}


def build_llm_client(cfg: DictConfig) -> Any:
    from nexrl.inference.client import LLMServiceClient

    return LLMServiceClient(inference_config(cfg))


def build_dataloader(cfg: DictConfig, is_validate: bool = False) -> Any:
    from nexrl.data import create_dataloader

    return create_dataloader(
        cfg.validate.data if is_validate else cfg.data, is_validate=is_validate
    )


def build_validate_dataloader(cfg: DictConfig) -> Any:
    return build_dataloader(cfg, is_validate=True)


def build_rollout_worker(cfg: DictConfig) -> Any:
    from nexrl.rewards import get_reward_fn
    from nexrl.rollout.workers import SimpleRolloutWorker, SingleTurnRolloutWorker

    section = {
        **_plain(cfg.rollout_worker),
        "prompt_key": cfg.data.prompt_key,
        "validate_temperature": cfg.validate.temperature,
        "enable_partial_rollout": cfg.weight.enable_partial_rollout,
        "tail_batch_candidate_steps": cfg.weight.tail_batch_candidate_steps,
    }
    client = build_llm_client(cfg)
    kind = section["type"]
    if kind == "single_turn":
        return SingleTurnRolloutWorker(section, client, get_reward_fn(section["reward_fn"]))
    if kind == "simple":
        return SimpleRolloutWorker(section, client)
    return import_path(kind)(section, client)


def build_trajectory_pool(cfg: DictConfig) -> Any:
    from nexrl.pools import TrajectoryPool

    return TrajectoryPool(cfg.trajectory_pool)


def build_train_batch_pool(cfg: DictConfig) -> Any:
    from nexrl.pools import TrainBatchPool

    return TrainBatchPool(cfg.train_batch_pool)


def build_algorithm_processor(cfg: DictConfig) -> Any:
    from transformers import AutoTokenizer

    from nexrl.algorithms.processor import GRPOProcessor

    section = {
        **_plain(cfg.algorithm),
        "batch_size": cfg.trajectory_pool.batch_size,
        "max_tokens": cfg.rollout_worker.max_tokens,
    }
    pad_id = AutoTokenizer.from_pretrained(cfg.model_path).pad_token_id or 0
    if section["type"] == "grpo":
        return GRPOProcessor(section, pad_token_id=pad_id)
    return import_path(section["type"])(section, pad_token_id=pad_id)


def build_train_worker(cfg: DictConfig) -> Any:
    from nexrl.training.client import TrainServiceClient
    from nexrl.training.train_worker import TrainWorker

    engine = _plain(cfg.train_worker.engine)
    engine["total_steps"] = engine["total_steps"] or cfg.train_worker.total_train_steps
    client = TrainServiceClient(_plain(cfg.service.train_service), engine, cfg.model_path)
    return TrainWorker(
        cfg.train_worker,
        client,
        async_loss_defaults(_plain(cfg.algorithm), cfg.weight.sync_mode),
        checkpoint_path=cfg.train_worker.checkpoint_path,
        sync_weight_path=cfg.train_worker.sync_weight_path,
    )


def async_loss_defaults(algorithm: dict[str, Any], sync_mode: str) -> dict[str, Any]:
    """Async modes train on samples from older weights: token-level truncated IS
    (cap 2) by default, unless the user chose an off-policy correction (docs/async.md)."""
    kwargs = dict(algorithm.get("loss_kwargs") or {})
    chosen = any(k in kwargs for k in ("tis_level", "decoupled"))
    if sync_mode != "sync" and not chosen:
        kwargs.update(tis_level="token", tis_cap=2.0)
    return {**algorithm, "loss_kwargs": kwargs}


def build_weight_sync_controller(cfg: DictConfig) -> Any:
    from nexrl.weight_sync import WeightSyncController

    pool = cfg.trajectory_pool
    groups_per_batch = max(1, pool.batch_size // pool.group_size) if pool.key_list else None
    backend = cfg.service.inference_service.backend
    if cfg.weight.inflight_weight_update and backend not in ("builtin", "remote"):
        raise ValueError(
            f"weight.inflight_weight_update=true needs the built-in engine (backend builtin, "
            f"or remote to a `nexrl serve`); service.inference_service.backend is {backend!r}"
        )
    return WeightSyncController(
        {**_plain(cfg.weight), "groups_per_batch": groups_per_batch},
        build_llm_client(cfg),
        cfg.train_worker.sync_weight_path,
    )


def build_validator(cfg: DictConfig) -> Any:
    from nexrl.validation import Validator

    return Validator(cfg.validate.eval)


BUILDERS: dict[NexRLRole, Callable[[DictConfig], Any]] = {
    NexRLRole.DATA_LOADER: build_dataloader,
    NexRLRole.VALIDATE_DATALOADER: build_validate_dataloader,
    NexRLRole.ROLLOUT_WORKER: build_rollout_worker,
    NexRLRole.TRAJECTORY_POOL: build_trajectory_pool,
    NexRLRole.TRAIN_BATCH_POOL: build_train_batch_pool,
    NexRLRole.ALGORITHM_PROCESSOR: build_algorithm_processor,
    NexRLRole.TRAIN_WORKER: build_train_worker,
    NexRLRole.WEIGHT_SYNC_CONTROLLER: build_weight_sync_controller,
    NexRLRole.VALIDATOR: build_validator,
}
