"""Data-parallel training on a `RayWorkerGroup`: `RayDataParallelTrainClient`.

The train worker keeps its one-client view: this class has the `TrainServiceClient`
surface, and behind it one built-in engine per bundle of a `RayVirtualCluster`,
joined into one process group (gloo on CPU, NCCL on GPU) by
`nexrl.training.parallel`. Each call shards the batch contiguously across the ranks
(`shard_batch`) with `run_all_workers_multiple_data`; logprobs come back in row
order; the engine all-reduces its counts, so rank 0's metrics are the global ones and
the result equals one process on the whole batch. Calls that are collectives under
FSDP2 (save, load, export) run on every rank; rank 0's answer is returned.

Enabled by `ray.train_ranks.bundles_per_node` (e.g. `[2]`); see docs/ray.md.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, overload

import torch
from omegaconf import DictConfig, OmegaConf

from nexrl.distributed.virtual_cluster import RayVirtualCluster
from nexrl.distributed.worker_group import RayWorkerGroup
from nexrl.protocols import TrainWorkerLike
from nexrl.training.client import TrainServiceClient
from nexrl.training.parallel import shard_batch
from nexrl.types import Batch


class RayDataParallelTrainClient:
    """`TrainServiceClient` over `sum(bundles_per_node)` data-parallel engine ranks."""

    def __init__(
        self,
        config: Mapping[str, Any],
        engine_config: Mapping[str, Any],
        model_path: str,
        bundles_per_node: list[int],
        num_cpus_per_bundle: float = 1.0,
        num_gpus_per_bundle: float = 0.0,
        env_vars: dict[str, str] | None = None,
        node_resources: list[dict[str, float]] | None = None,
    ) -> None:
        self.config = dict(config or {})
        if self.config.get("backend", "builtin") != "builtin":
            raise ValueError("ray.train_ranks needs service.train_service.backend=builtin")
        self.engine_config = dict(engine_config)
        self.model_path = str(model_path)
        self.model_tag = self.config.get("model_tag", "default")
        self._layout = functools.partial(
            RayVirtualCluster,
            bundle_ct_per_node_list=list(bundles_per_node),
            use_gpus=num_gpus_per_bundle > 0,
            num_gpus_per_bundle=num_gpus_per_bundle or 1.0,
            num_cpus_per_bundle=num_cpus_per_bundle,
            name="nexrl-train",
            node_resources=node_resources,
        )
        self._env_vars = env_vars
        self.cluster: RayVirtualCluster | None = None
        self.group: RayWorkerGroup | None = None

    def initialize(self) -> None:
        """Place the ranks, join the process group, build one engine per rank."""
        self.cluster = self._layout()
        self.group = RayWorkerGroup(
            self.cluster,
            TrainServiceClient,
            self.config,
            self.engine_config,
            self.model_path,
            env_vars=self._env_vars,
        )
        self._all("initialize")

    def _all(self, method: str, *args: Any) -> list[Any]:
        group = self._group()
        return group.get_results(group.run_all_workers_single_data(method, *args))

    def _sharded(self, method: str, batch: Batch, *args: Any) -> list[Any]:
        group = self._group()
        world = group.num_tied_groups
        if len(batch) < world:
            raise ValueError(f"{method}: a batch of {len(batch)} rows for {world} ranks")
        shards = [shard_batch(batch, r, world) for r in range(world)]
        return group.get_results(group.run_all_workers_multiple_data(method, shards, *args))

    def _group(self) -> RayWorkerGroup:
        if self.group is None:
            raise RuntimeError("RayDataParallelTrainClient.initialize() was not called")
        return self.group

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """(B, T) logprobs, the ranks' shards concatenated in row order."""
        return torch.cat(self._sharded("compute_logprobs", batch), dim=0)

    def compute_ref_logprobs(self, batch: Batch) -> torch.Tensor | None:
        parts = self._sharded("compute_ref_logprobs", batch)
        return None if parts[0] is None else torch.cat(parts, dim=0)

    def train_batch(
        self, batch: Batch, loss_fn: str, loss_kwargs: dict[str, Any]
    ) -> dict[str, float]:
        """One optimizer step on every rank; rank 0's (global) metrics."""
        return self._sharded("train_batch", batch, loss_fn, loss_kwargs)[0]

    def save_checkpoint(self, path: str) -> None:
        self._all("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        self._all("load_checkpoint", path)

    @overload
    def export_weights(self, path: None = None, copy: bool = True) -> dict[str, torch.Tensor]: ...
    @overload
    def export_weights(self, path: str, copy: bool = True) -> str: ...
    def export_weights(
        self, path: str | None = None, copy: bool = True
    ) -> dict[str, torch.Tensor] | str:
        """Rank 0's weights (a copy: they come from the rank actors)."""
        return self._all("export_weights", path)[0]

    def get_step(self) -> int:
        group = self._group()
        step = group.get_results([group.workers[0].call.remote("get_step")])[0]
        if not isinstance(step, int):
            raise TypeError(f"get_step: rank 0 answered {step!r}")
        return step

    def close(self) -> None:
        if self.group is not None:
            self.group.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
        self.group = self.cluster = None


def build_ray_train_worker(cfg: DictConfig) -> TrainWorkerLike:
    """TRAIN_WORKER builder for Ray mode: data-parallel ranks when `ray.train_ranks` asks."""
    from nexrl.builders import build_train_worker, engine_config
    from nexrl.distributed.settings import RaySettings, actor_env

    settings = RaySettings.from_config(cfg)
    ranks = dataclasses.asdict(settings.train_ranks)
    if not ranks["bundles_per_node"]:
        return build_train_worker(cfg)
    section = OmegaConf.to_container(cfg.service.train_service, resolve=True)
    if not isinstance(section, dict):
        raise TypeError(f"service.train_service must be a mapping, got {section!r}")
    client = RayDataParallelTrainClient(
        {str(key): value for key, value in section.items()},
        dataclasses.asdict(engine_config(cfg)),
        cfg.model_path,
        env_vars=actor_env(settings),
        **ranks,
    )
    return build_train_worker(cfg, client=client)
