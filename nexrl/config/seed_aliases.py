"""Config names from seed 000 (the NexRL guide) and seed 003 (xtuner) that nexrl spells
differently: each is accepted and mapped, or refused with a message naming nexrl's key.

Accepted (mapped):
- `rollout_worker.type: single_turn_math` -> `single_turn` with `reward_fn: math` (unless
  a reward_fn is given);
- `logger.backend` as a string (`wandb`, or `jsonl,console` on the command line) -> a list;
- seed 004's `rollout.workflow.KEY=VALUE` -> `rollout_worker.workflow_kwargs.config.KEY`
  (an agent workflow's `config`, handed over with attribute access).

Refused with nexrl's equivalent: the `mock` worker / processor / train backend / data
loader, `nextrainer`, `train_batch_pool.batch_size`, `weight.checkpoint_manager`,
`service.train_service.identifier`, and a fractional `weight.staleness_threshold` (xtuner's
fraction is `weight.over_sample_threshold`). The `type` of the pools, the train worker,
the weight controller and the validator has one value, `default`; any other is refused
rather than ignored.

`load_config` calls `rewrite_overrides` before composing, `explain` when composing fails
(a seed key in a yaml file), and `check` on the composed config.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from omegaconf import DictConfig, OmegaConf

from nexrl.config.suggest import ConfigError

logger = logging.getLogger(__name__)

REFUSED_KEYS: dict[str, str] = {
    "train_batch_pool.batch_size": (
        "the train batch is trajectory_pool.batch_size (one pool batch is one train batch); "
        "set that instead"
    ),
    "weight.checkpoint_manager": (
        "checkpoints belong to the train worker: train_worker.checkpoint_path, "
        "train_worker.save_freq and train_worker.remove_previous_ckpt"
    ),
    "service.train_service.identifier": (
        "a train service is named by service.train_service.model_tag and reached at "
        "service.train_service.url"
    ),
}

REFUSED_VALUES: dict[tuple[str, str], str] = {
    ("rollout_worker.type", "mock"): (
        "nexrl has no mock worker; `simple` generates without a reward on the embedded tiny "
        "model (model_path: null), which runs anywhere"
    ),
    ("algorithm.type", "mock"): (
        "nexrl has no mock processor; `grpo` with the embedded tiny model, or a class as "
        "`package.module:Class`"
    ),
    ("service.train_service.backend", "mock"): (
        "nexrl has no mock trainer; `builtin` trains the embedded tiny model on a CPU"
    ),
    ("service.train_service.backend", "nextrainer"): (
        "NexTrainer is not bundled; `remote` talks to a `nexrl train-service` over HTTP"
    ),
    ("data.type", "mock"): "nexrl has no mock loader; `hf` with data.path: null uses data.task",
    ("data.type", "torch"): "the loader is `hf` (Hugging Face datasets, resumable cursor)",
}

DEFAULT_ONLY = (
    "trajectory_pool.type",
    "train_batch_pool.type",
    "train_worker.type",
    "weight.type",
    "validate.eval.type",
)


def _refused(key: str, value: str | None = None) -> ConfigError:
    if value is None:
        return ConfigError(f"{key} is a seed-guide key nexrl does not use: {REFUSED_KEYS[key]}")
    return ConfigError(f"{key}={value!r}: {REFUSED_VALUES[(key, value)]}")


def _staleness(value: Any) -> None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return  # the schema reports a non-number
    if number != int(number):
        raise ConfigError(
            f"weight.staleness_threshold={value}: nexrl's staleness_threshold is an integer "
            "(train steps a sample may lag); xtuner's fraction of extra requests is "
            f"weight.over_sample_threshold={value}"
        )


def rewrite_overrides(overrides: list[str]) -> list[str]:
    """Overrides with seed spellings mapped; a refused seed key raises `ConfigError`."""
    out: list[str] = []
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}
    for item in overrides:
        if "=" not in item:
            out.append(item)
            continue
        raw_key, value = item.split("=", 1)
        key = raw_key.lstrip("+~")
        if key in REFUSED_KEYS:
            raise _refused(key)
        if (key, value) in REFUSED_VALUES:
            raise _refused(key, value)
        if key == "weight.staleness_threshold":
            _staleness(value)
        if key == "logger.backend" and not value.startswith("["):
            names = [n.strip() for n in value.strip("'\"").split(",") if n.strip()]
            item = f"{raw_key}=[{','.join(names)}]"
        if key.startswith("rollout.workflow."):  # seed 004: the workflow's own config
            sub = key.removeprefix("rollout.workflow.")
            item = f"+rollout_worker.workflow_kwargs.config.{sub}={value}"
        if key == "rollout_worker.type" and value == "single_turn_math":
            item = f"{raw_key}=single_turn"
            if "rollout_worker.reward_fn" not in keys:
                out.append("rollout_worker.reward_fn=math")
        out.append(item)
    return out


_FULL_KEY = re.compile(r"full_key: ([\w.]+)")


def explain(message: str) -> str | None:
    """A compose error caused by a seed key (in a yaml file), explained; else None."""
    for key in _FULL_KEY.findall(message):
        if key in REFUSED_KEYS:
            return str(_refused(key))
        if key == "weight.staleness_threshold":
            return (
                "weight.staleness_threshold must be an integer (train steps a sample may lag); "
                "xtuner's fraction of extra requests is weight.over_sample_threshold"
            )
        if key == "logger.backend":
            return "logger.backend is a list in a yaml file: backend: [wandb] (or [jsonl, console])"
    return None


def check(cfg: DictConfig) -> None:
    """Map or refuse seed values in the composed config (they may come from a yaml file)."""
    if cfg.rollout_worker.type == "single_turn_math":
        cfg.rollout_worker.type = "single_turn"
        if cfg.rollout_worker.reward_fn == "shift_letters":  # the default: the seed means math
            cfg.rollout_worker.reward_fn = "math"
        logger.info("rollout_worker.type=single_turn_math: single_turn with %s reward",
                    cfg.rollout_worker.reward_fn)  # fmt: skip
    for key, value in REFUSED_VALUES:
        if OmegaConf.select(cfg, key) == value:
            raise _refused(key, value)
    for key in DEFAULT_ONLY:
        value = OmegaConf.select(cfg, key)
        if value != "default":
            raise ConfigError(
                f"{key}={value!r}: nexrl has one implementation, `default`; custom behaviour "
                "goes in rollout_worker.type / algorithm.type (an import path) instead"
            )
