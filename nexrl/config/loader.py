"""Load and validate a run configuration with Hydra's compose API.

The packaged `rl_train.yaml` starts from the structured schema
(`rl_train_schema`), so Hydra itself rejects unknown keys and wrong types in
yaml files and command-line overrides. A user config lives in any folder and
begins with `defaults: [rl_train, _self_]` to inherit the packaged default.
"""

from __future__ import annotations

import logging
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from nexrl.config import seed_aliases
from nexrl.config.derived import groups_per_batch, train_backend, weights_in_memory
from nexrl.config.schema import CHOICES, RLTrainConfig
from nexrl.config.suggest import ConfigError, check_known_keys, explain_unknown_key
from nexrl.registry import RegistryError
from nexrl.training.backends import REMOTE, TRAIN_ENGINES

PACKAGE_CONFIG_DIR = Path(__file__).parent
logger = logging.getLogger(__name__)


def register_schema() -> None:
    """Make `rl_train_schema` (the packaged yaml's base) known to Hydra."""
    ConfigStore.instance().store(name="rl_train_schema", node=RLTrainConfig)


def load_config(
    overrides: list[str] | None = None,
    config_name: str = "rl_train",
    config_dir: str | Path | None = None,
) -> DictConfig:
    """Compose `config_name` from `config_dir` (default: the packaged configs) with overrides."""
    register_schema()
    directory = Path(config_dir).resolve() if config_dir else PACKAGE_CONFIG_DIR
    overrides = seed_aliases.rewrite_overrides(list(overrides or []))  # seed 000/003 spellings
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(directory), version_base=None):
            cfg = compose(
                config_name,
                overrides=[*overrides, "hydra.searchpath=[pkg://nexrl.config]"],
            )
    except Exception as exc:  # hydra wraps the useful message in the cause chain
        msg = _explain(exc)
        raise ConfigError(seed_aliases.explain(msg) or explain_unknown_key(msg) or msg) from exc
    finally:
        GlobalHydra.instance().clear()
    seed_aliases.check(cfg)
    check_known_keys(cfg)
    validate_choices(cfg)
    warn_serial_groups(cfg)
    cfg.service.train_service.backend = train_backend(cfg)  # `auto` made concrete, here
    return cfg


def validate_choices(cfg: DictConfig) -> None:
    """Fail on a value outside the documented choices, naming key and choices."""
    for key, choices in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is not valid; choose one of {list(choices)}")
    if cfg.service.train_service.backend not in ("auto", REMOTE):
        try:  # registered by name, or "pkg.module:Class" (imported when the engine is built)
            TRAIN_ENGINES.check(cfg.service.train_service.backend)
        except RegistryError as exc:
            raise ConfigError(f"{exc}; or auto, remote") from None
    try:
        weights_in_memory(cfg)  # weight.transport=memory where it cannot work
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    for key in ("rollout_worker.num_workers", "train_worker.num_workers", "validate.concurrency"):
        if OmegaConf.select(cfg, key) < 1:
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)} must be >= 1")
    if cfg.train_worker.num_workers > 1:
        raise ConfigError(
            f"train_worker.num_workers={cfg.train_worker.num_workers}: a run has one train "
            "worker (one optimizer); for data-parallel training start it with torchrun "
            "(WORLD_SIZE, train_worker.engine.dp_strategy) or set ray.train_ranks"
        )
    if cfg.trajectory_pool.batch_size % max(cfg.trajectory_pool.group_size, 1):
        raise ConfigError(
            f"trajectory_pool.batch_size={cfg.trajectory_pool.batch_size} must be a multiple of "
            f"trajectory_pool.group_size={cfg.trajectory_pool.group_size}"
        )


def warn_serial_groups(cfg: DictConfig) -> None:
    """Warn when a train batch's groups cannot all be generating at once: each rollout
    worker runs one group at a time, so fewer workers than groups per batch send a step's
    prompts to the engine in rounds instead of one batch."""
    groups, workers = groups_per_batch(cfg), cfg.rollout_worker.num_workers
    if workers < groups:
        logger.warning(
            "rollout_worker.num_workers=%d is below the %d groups of a train batch "
            "(trajectory_pool.batch_size / group_size): a step's prompts reach the engine "
            "in %d rounds; set rollout_worker.num_workers=%d to generate them together",
            workers, groups, -(-groups // workers), groups,
        )  # fmt: skip


def _explain(exc: BaseException | None) -> str:
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc).strip()
        if text and text not in parts and "$VALUE" not in text:
            parts.append(text)
        exc = exc.__cause__ or exc.__context__
    return "invalid configuration: " + " | ".join(parts)
