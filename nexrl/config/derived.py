"""Facts derived from a run config that the config check and the builders both need.

No torch here: `load_config` checks them before anything heavy is imported, so a bad
config fails in a fraction of a second and `nexrl train` can spawn a trainer child
before its own imports (nexrl/training/trainer_spare.py).
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

LOCAL_BACKENDS = ("builtin", "hf")
"""Inference backends whose engine runs in the client's process."""


def weights_in_memory(cfg: DictConfig) -> bool:
    """Whether pushed weights reach the engine as tensors rather than files
    (`weight.transport`). The engine must run in the weight-sync controller's process
    (an in-process inference backend, no inference replicas) and the trainer must be
    the built-in one (here or in its child process): in local mode the state dict is
    handed over by reference, in Ray mode it travels in the push call (Ray's object
    store) to the rollout actor."""
    transport = cfg.weight.get("transport", "auto")
    replicas = OmegaConf.select(cfg, "ray.inference_replicas.bundles_per_node", default=None)
    possible = (
        cfg.service.inference_service.backend in LOCAL_BACKENDS
        and cfg.service.train_service.backend in ("builtin", "process")
        and not (cfg.launch_mode == "ray" and replicas)
    )
    if transport == "memory" and not possible:
        raise ValueError(
            "weight.transport=memory needs the trainer built in "
            "(service.train_service.backend builtin or process) and the engine in the weight-sync "
            f"controller's process (service.inference_service.backend one of {LOCAL_BACKENDS}, "
            "no ray.inference_replicas); use file or auto"
        )
    return transport != "file" and possible


def groups_per_batch(cfg: DictConfig) -> int:
    """Rollout groups (tasks) per train batch: what admission counts in."""
    return max(1, cfg.trajectory_pool.batch_size // max(1, cfg.trajectory_pool.group_size))
