"""The experiment config of an AReaL-lite script: `load_expr_config(argv)`.

`python main.py --config my.yaml rollout.workflow.num_turns=2` gives
`(rollout_config, training_config)`, typed OmegaConf views with attribute
access. `rollout.workflow` is the user's own section: any keys, typed by
their yaml / command-line value (`rollout.workflow.x=1` is the int 1), handed
to the workflow's constructor. Every other section is a structured schema, so
a misspelt key or a wrong type fails at start naming the key.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf


@dataclass
class InferenceEngineConfig:
    path: str | None = None
    """Model directory; null: the embedded tiny model."""
    engine: dict[str, Any] = field(default_factory=dict)
    """Built-in engine options (docs/inference.md)."""
    addresses: list[str] = field(default_factory=list)
    """A running server (`host:port`) to use instead of the built-in engine (one)."""
    max_concurrent: int = 64
    """Episodes in flight at once."""
    upload_timeout_s: float = 600.0
    """How long a disk weight update waits for the trainer's upload."""
    api_key: str | None = None
    """Bearer token of a remote server."""
    timeout: float = 600.0
    """Seconds per remote request."""


@dataclass
class RolloutConfig:
    engine: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)
    controller: dict[str, Any] = field(default_factory=dict)
    """Options of a `RolloutController` (none are read in-process)."""
    workflow: dict[str, Any] = field(default_factory=dict)
    """The workflow's own keys (open section)."""


@dataclass
class TrainEngineConfig:
    path: str | None = None
    """Model directory; null: the embedded tiny model."""
    engine: dict[str, Any] = field(default_factory=dict)
    """nexrl `EngineConfig` options (lr, micro_batch_tokens, grad_clip, ...)."""
    ppo_n_minibatches: int = 1
    """Optimizer steps per `ppo_update` (row slices of the batch)."""
    loss_fn: str = "ppo_clip"
    """Actor: the policy loss (nexrl's registry)."""
    loss_kwargs: dict[str, Any] = field(default_factory=dict)
    """Actor: keyword arguments of `compute_loss`."""
    adv_estimator: str = "grpo"
    """Actor without critic values: the group advantage estimator."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 1.0
    """GAE lambda."""
    value_clip: float = 0.2
    """Critic: clip range of the value loss around the old values."""


@dataclass
class TrainingConfig:
    actor: TrainEngineConfig = field(default_factory=TrainEngineConfig)
    ref: TrainEngineConfig = field(default_factory=TrainEngineConfig)
    critic: TrainEngineConfig = field(default_factory=TrainEngineConfig)
    training_controller_config: dict[str, Any] = field(default_factory=dict)
    """Options of a `TrainController` (none are read in-process)."""
    epochs: int = 1
    """Passes over the dataset."""
    batch_size: int = 8
    """Prompts per step."""


@dataclass
class ExperimentConfig:
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)


def load_expr_config(argv: list[str]) -> tuple[DictConfig, DictConfig]:
    """`[--config FILE] [key=value ...]` -> (rollout config, training config)."""
    parser = argparse.ArgumentParser(prog="load_expr_config")
    parser.add_argument("--config", default=None, help="yaml file with rollout/training")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o or o.startswith("-")]
    if bad:
        raise ValueError(f"unrecognised arguments {bad}; overrides are key=value")
    cfg = OmegaConf.structured(ExperimentConfig)
    if args.config:
        cfg = OmegaConf.merge(cfg, OmegaConf.load(args.config))
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    return cfg.rollout, cfg.training
