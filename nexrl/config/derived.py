"""Facts derived from a run config that the config check and the builders both need.

No torch here: `load_config` checks them before anything heavy is imported, so a bad
config fails in a fraction of a second.
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig, OmegaConf

from nexrl.spawn import main_can_be_reimported

LOCAL_BACKENDS = ("builtin", "hf")
"""Inference backends whose engine runs in the client's process."""


def train_backend(cfg: DictConfig) -> str:
    """`service.train_service.backend` made concrete. `auto` is `process` for a local
    fully-async run with an in-process engine and `staleness_threshold` >= 1: the
    trainer then updates while the next batch is generated and shares no interpreter
    lock with that rollout, the fastest mode measured (docs/performance.md). It is
    `builtin` where that gains nothing or was not measured (sync mode takes turns; at
    staleness 0 admission holds the next batch until the weights are pushed, so the
    update never overlaps a rollout; batch-async; in Ray mode the train worker is a
    process already; a remote engine's rollout side is light) and where the spawned
    child could not work as this process does: a script that the child cannot import
    again (no `__main__` guard), or a loss, aggregation or KL estimator that user code
    registered by name (the child may not run that registration)."""
    backend = OmegaConf.select(cfg, "service.train_service.backend", default="builtin")
    if backend != "auto":
        return str(backend)
    local = OmegaConf.select(cfg, "launch_mode", default="local") == "local"
    fully_async = OmegaConf.select(cfg, "weight.sync_mode", default="sync") == "fully-async"
    overlaps = OmegaConf.select(cfg, "weight.staleness_threshold", default=0) >= 1
    engine = OmegaConf.select(cfg, "service.inference_service.backend", default="builtin")
    here = local and fully_async and overlaps and engine in LOCAL_BACKENDS
    child_fits = main_can_be_reimported() and not _user_registered_loss_parts()
    return "process" if here and child_fits else "builtin"


def _user_registered_loss_parts() -> list[str]:
    """Losses, aggregations and KL estimators (what the trainer looks up by name) that
    code outside nexrl registered in this process. Read only if this process imported
    the algorithm library: before that nothing can be registered in it."""
    algorithms = sys.modules.get("nexrl.algorithms")
    if algorithms is None:
        return []
    found = []
    for registry in (algorithms.POLICY_LOSSES, algorithms.AGGREGATIONS, algorithms.KL_ESTIMATORS):
        found += registry.registered_outside("nexrl")
    return found


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
        and train_backend(cfg) in ("builtin", "process")
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
    pool = cfg.trajectory_pool
    return max(1, int(pool.batch_size) // max(1, int(pool.group_size)))
