"""`ray.*` settings, shared by the Ray system and the data-parallel train worker.

Kept apart from `ray_system` so that modules built inside actors (the
data-parallel train client) need not import the system that builds them.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf

from nexrl.config.options import RayGroupConfig, RayRanksConfig
from nexrl.config.schema import RayConfig
from nexrl.distributed.resource_manager import GroupOptions
from nexrl.types import NexRLRole

ONE_ACTOR_COLOCATION: dict[str, str | None] = {role.value: "main" for role in NexRLRole}
"""Every module in one `main` actor: the trainer hands its weights to the engine in
memory and no batch crosses between processes, as in local mode (and as in a colocated
"hybrid engine" trainer). Ray then adds the driver's controller calls and the activity
tracker, and the run can still place train ranks and inference replicas
(`ray.train_ranks`, `ray.inference_replicas`) on actors of their own."""

ROLLOUT_TRAIN_COLOCATION: dict[str, str | None] = {
    NexRLRole.DATA_LOADER.value: "rollout",
    NexRLRole.VALIDATE_DATALOADER.value: "rollout",
    NexRLRole.TRAJECTORY_POOL.value: "rollout",
    NexRLRole.VALIDATOR.value: "rollout",
    NexRLRole.ROLLOUT_WORKER.value: "rollout",
    NexRLRole.WEIGHT_SYNC_CONTROLLER.value: "rollout",
    NexRLRole.TASK_ADMISSION.value: "rollout",
    NexRLRole.TRAIN_BATCH_POOL.value: "train",
    NexRLRole.TRAIN_WORKER.value: "train",
    NexRLRole.ALGORITHM_PROCESSOR.value: "train",
}
"""Two actors, split where data must cross anyway: each rollout task touches the loader,
the task owner (`task_admission`), the trajectory pool and (validating) the validator, so
they live with the rollout workers; the processor and the train worker share the train
batch pool. One batch per step crosses from `rollout` to `train` (the processor's
`get_batch`), and the weights cross back in each push."""

SPLIT_COLOCATION: dict[str, str | None] = {
    **{
        role: "data"
        for role in (
            NexRLRole.DATA_LOADER.value,
            NexRLRole.VALIDATE_DATALOADER.value,
            NexRLRole.TRAJECTORY_POOL.value,
            NexRLRole.TRAIN_BATCH_POOL.value,
            NexRLRole.VALIDATOR.value,
        )
    },
    NexRLRole.TRAIN_WORKER.value: "train",
    NexRLRole.ALGORITHM_PROCESSOR.value: "train",
    NexRLRole.ROLLOUT_WORKER.value: "rollout",
    NexRLRole.WEIGHT_SYNC_CONTROLLER.value: "rollout",
    NexRLRole.TASK_ADMISSION.value: "rollout",
}
"""Loaders, pools and the validator in a `data` actor of their own. Every task then
costs two more Ray calls (the loader item, the trajectory group); docs/ray.md."""

LAYOUTS: dict[str, dict[str, str | None]] = {
    "one_actor": ONE_ACTOR_COLOCATION,
    "rollout_train": ROLLOUT_TRAIN_COLOCATION,
    "split": SPLIT_COLOCATION,
}
"""`ray.layout` -> its colocation (role -> group); `ray.colocation` is merged over it."""
DEFAULT_COLOCATION = LAYOUTS[RayConfig.layout]
IN_PROCESS_BACKENDS = ("builtin", "hf")


@dataclass
class RaySettings(RayConfig):
    """The `ray.*` section (schema: `nexrl.config.schema.RayConfig`, docs/ray.md) with the
    colocation layout resolved over `DEFAULT_COLOCATION`."""

    colocation: dict[str, str | None] = field(default_factory=lambda: dict(DEFAULT_COLOCATION))

    @classmethod
    def from_config(cls, config: DictConfig) -> RaySettings:
        section = OmegaConf.select(config, "ray", default=None)
        tree = OmegaConf.to_container(section, resolve=True) if section is not None else {}
        if not isinstance(tree, dict):
            raise ValueError(f"ray must be a mapping of ray.* keys, got {tree!r}")
        unknown = sorted(set(map(str, tree)) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"unknown ray key(s) {unknown}; valid: {sorted(cls.__dataclass_fields__)}"
            )
        raw: dict[str, Any] = {str(k): v for k, v in tree.items() if v is not None}
        layout = raw.get("layout", RayConfig.layout)
        if layout not in LAYOUTS:
            raise ValueError(f"ray.layout={layout!r}; choose one of {sorted(LAYOUTS)}")
        colocation = {**LAYOUTS[layout], **(raw.pop("colocation", None) or {})}
        bad = sorted(set(colocation) - {r.value for r in NexRLRole})
        if bad:
            raise ValueError(
                f"ray.colocation: unknown role(s) {bad}; roles: {[r.value for r in NexRLRole]}"
            )
        groups = {
            g: _typed(RayGroupConfig, f"ray.groups.{g}", o)
            for g, o in raw.pop("groups", {}).items()
        }
        for key in ("train_ranks", "inference_replicas"):
            if key in raw:
                raw[key] = _typed(RayRanksConfig, f"ray.{key}", raw[key])
        return cls(**raw, groups=groups, colocation=colocation)

    def module_threads(self) -> int:
        """Torch threads of each module actor (`ray.torch_threads`, see the schema)."""
        if self.torch_threads is not None:
            if int(self.torch_threads) < 1:
                raise ValueError(f"ray.torch_threads must be >= 1, got {self.torch_threads}")
            return int(self.torch_threads)
        env = os.environ.get("NEXRL_ACTOR_THREADS") or os.environ.get("OMP_NUM_THREADS")
        if env:
            return int(env)
        import torch

        return max(1, torch.get_num_threads() // self.module_actors())

    def module_actors(self) -> int:
        """Module actors this layout starts: one per named group, one per role set to null."""
        named = {group for group in self.colocation.values() if group}
        return len(named) + sum(group is None for group in self.colocation.values())

    def group_options(self) -> dict[str, GroupOptions]:
        """Each colocation group's actor options: its `ray.groups` entry, with
        `ray.max_concurrency` and `ray.max_restarts` where the entry leaves them null."""
        names = {g for g in self.colocation.values() if g} | set(self.groups)
        out = {}
        for name in names:
            group = self.groups.get(name) or RayGroupConfig()
            out[name] = GroupOptions(
                num_cpus=group.num_cpus,
                num_gpus=group.num_gpus,
                max_concurrency=_or(group.max_concurrency, self.max_concurrency),
                max_restarts=_or(group.max_restarts, self.max_restarts),
                resources=dict(group.resources),
            )
        return out


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def _typed(cls: type[Any], key: str, value: Any) -> Any:
    """`value` (a mapping, or already a `cls`) as a `cls`; an unknown key is a ValueError
    naming it under `key`."""
    if isinstance(value, cls):
        return value
    value = dict(value or {})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{key}: unknown key(s) {unknown}; valid: {sorted(known)}")
    return cls(**value)


QUIET_RAY_ENV = {
    "RAY_worker_niceness": "0",
    "RAY_prestart_worker_first_driver": "0",  # every actor starts a worker of its own
    "RAY_enable_metrics_collection": "0",
}
"""Set (unless already set) before a local `ray.init`: the raylet and workers read them."""


def init_ray(settings: RaySettings) -> bool:
    """`ray.init` unless already connected; True when this call started/connected Ray."""
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"namespace": settings.namespace}
    if settings.address:  # joining a cluster: its resources are set by `ray start`
        kwargs["address"] = settings.address
    else:
        kwargs.update(
            num_cpus=settings.num_cpus, num_gpus=settings.num_gpus, include_dashboard=False
        )
        # Ray starts its workers at niceness +15 over the driver; the modules then lose
        # every contended core to any other process, where local mode's threads do not.
        # Idle pre-started workers and the metrics agent wake up on their own timers: each
        # wake-up preempts a torch thread of a step (benchmarks/results/ray.md).
        for name, value in QUIET_RAY_ENV.items():
            os.environ.setdefault(name, value)
    ray.init(**kwargs, runtime_env={"env_vars": actor_env(settings)})
    return True


def actor_env(settings: RaySettings) -> dict[str, str]:
    """What actors inherit from the driver: NEXRL_* variables, the import path, timeouts,
    and torch's threads (`OMP_NUM_THREADS`): `NEXRL_ACTOR_THREADS`, else the driver's
    `OMP_NUM_THREADS`, else 1 (what Ray sets in actors that reserve no CPU). Module
    actors get `RaySettings.module_threads()` instead: two actors of two threads each on
    two cores spin-waited against each other (benchmarks/results/ray.md).
    """
    env = {k: v for k, v in os.environ.items() if k.startswith(("NEXRL_", "HF_"))}
    paths = [os.getcwd(), *[p for p in sys.path if p and os.path.isdir(p)]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["NEXRL_EXECUTE_TIMEOUT_S"] = str(settings.execute_timeout_s)
    threads = os.environ.get("NEXRL_ACTOR_THREADS") or os.environ.get("OMP_NUM_THREADS")
    env["OMP_NUM_THREADS"] = threads or "1"
    return env
