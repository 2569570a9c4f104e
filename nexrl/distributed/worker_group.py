"""`RayWorkerGroup`: one worker actor per bundle of a `RayVirtualCluster` (seed 002).

Each worker gets the torch.distributed environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
`LOCAL_WORLD_SIZE`, `NODE_RANK`, `MASTER_ADDR`, `MASTER_PORT`) before it builds its
object: ranks count the bundles node by node, `LOCAL_RANK` restarts at 0 on each
(virtual) node, `NODE_RANK` is the node's index among the nodes with bundles, and the
rendezvous is rank 0's node IP, so SPMD code such as
`nexrl.training.parallel` joins the process group exactly as under `torchrun`.
Usage order: create the group (workers start, rank 0 picks the rendezvous address,
every worker then builds `factory(*args)`), then call methods on all workers:

    run_all_workers_single_data("m", x)         every worker runs m(x)
    run_all_workers_multiple_data("m", [x0, x1]) tied group g runs m(x_g)

Both return one ObjectRef per worker (in rank order); `get_results(refs)` waits for
them. Tied workers (`tied_group_size` k > 1, e.g. the ranks of one tensor-parallel
model) are consecutive ranks that receive the same data.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray import ObjectRef
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from nexrl.distributed.resource_manager import runtime_env_for
from nexrl.distributed.virtual_cluster import RayVirtualCluster
from nexrl.execute import default_timeout


class RayWorker:
    """Holds one object built by `factory(*args, **kwargs)` after the env is set."""

    def __init__(self, env: dict[str, str]) -> None:
        os.environ.update(env)
        self._obj: object = None

    def rendezvous_address(self) -> tuple[str, int]:
        """(this node's IP, a free port): where rank 0 hosts the process group."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return ray.util.get_node_ip_address(), port

    def build(
        self,
        env: dict[str, str],
        factory: Callable[..., object],
        args: tuple[object, ...],
        kwargs: dict[str, object],
    ) -> None:
        os.environ.update(env)
        self._obj = factory(*args, **kwargs)

    def call(self, method: str, *args: object, **kwargs: object) -> object:
        return getattr(self._obj, method)(*args, **kwargs)

    def env(self, key: str) -> str | None:
        return os.environ.get(key)


class RayWorkerGroup:
    """Workers on the bundles of `cluster`, ranks in bundle order."""

    def __init__(
        self,
        cluster: RayVirtualCluster,
        factory: Callable[..., object],
        *args: object,
        tied_group_size: int = 1,
        num_cpus_per_worker: float | None = None,
        num_gpus_per_worker: float | None = None,
        env_vars: dict[str, str] | None = None,
        **kwargs: object,
    ) -> None:
        world = cluster.world_size
        if tied_group_size < 1 or world % tied_group_size:
            raise ValueError(
                f"tied_group_size={tied_group_size} must divide the world size {world}"
            )
        self.cluster = cluster
        self.tied_group_size = tied_group_size
        cpus = cluster.bundle["CPU"] if num_cpus_per_worker is None else num_cpus_per_worker
        gpus = (
            cluster.bundle.get("GPU", 0.0) if num_gpus_per_worker is None else num_gpus_per_worker
        )
        # Ray types a method of a handle as Any: `.call.remote` is not checked
        self.workers: list[ActorHandle[RayWorker]] = []
        worker_cls: Any = ray.remote(RayWorker)  # an actor class (Ray's stubs say function)
        groups = cluster.get_placement_groups()
        for rank, (pg, index) in enumerate(cluster.bundle_locations()):
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(index),
                "LOCAL_WORLD_SIZE": str(pg.bundle_count),
                "NODE_RANK": str(groups.index(pg)),
            }
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
            actor = worker_cls.options(
                num_cpus=cpus,
                num_gpus=gpus,
                scheduling_strategy=strategy,
                runtime_env=runtime_env_for(env_vars or {}),
            )
            self.workers.append(actor.remote(env))
        addr, port = ray.get(self.workers[0].rendezvous_address.remote())
        self.master = {"MASTER_ADDR": addr, "MASTER_PORT": str(port)}
        self.get_results([w.build.remote(self.master, factory, args, kwargs) for w in self.workers])

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def num_tied_groups(self) -> int:
        return len(self.workers) // self.tied_group_size

    def run_all_workers_single_data(
        self, method: str, *args: object, **kwargs: object
    ) -> list[ObjectRef[object]]:
        """Every worker runs `method(*args, **kwargs)`; one ObjectRef per worker."""
        return [w.call.remote(method, *args, **kwargs) for w in self.workers]

    def run_all_workers_multiple_data(
        self, method: str, data: Sequence[object], *args: object, **kwargs: object
    ) -> list[ObjectRef[object]]:
        """Tied group g (ranks g*k .. g*k+k-1) runs `method(data[g], ...)`."""
        if len(data) != self.num_tied_groups:
            raise ValueError(
                f"run_all_workers_multiple_data({method!r}): {len(data)} data items for "
                f"{self.num_tied_groups} tied groups of {self.tied_group_size} worker(s)"
            )
        return [
            w.call.remote(method, data[rank // self.tied_group_size], *args, **kwargs)
            for rank, w in enumerate(self.workers)
        ]

    def get_results(
        self, refs: list[ObjectRef[object]], timeout: float | None = None
    ) -> list[object]:
        return ray.get(refs, timeout=timeout if timeout is not None else default_timeout())

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
