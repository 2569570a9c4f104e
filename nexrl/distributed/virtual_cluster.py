"""`RayVirtualCluster`: a slice of the Ray cluster as placement groups (seed 002).

One placement group per (virtual) node, `STRICT_PACK`ed so that the bundles of a node
land on one machine: `[4, 4]` = two nodes of four bundles, each bundle one GPU (or one
CPU slot without GPUs) plus `num_cpus_per_bundle` CPUs. Worker groups place one worker
per bundle (`RayWorkerGroup`). A request that the cluster cannot satisfy fails after
`placement_timeout_s` with the resources it asked for and what the cluster has, instead
of waiting forever as a bare `pg.ready()` would.

Ray places each node's group on any machine with room, so two virtual nodes may share
one machine. `node_resources` pins virtual node k to the machines that offer the custom
resources `node_resources[k]` (e.g. `{"node_a": 1}` from `ray start --resources`):
every bundle of that node asks for them. `node_ids()` says where each node landed.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Mapping

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

logger = logging.getLogger(__name__)


class PlacementGroupUnsatisfiable(RuntimeError):
    """A placement group did not become ready in time; the message names what is missing."""


class RayVirtualCluster:
    """Placement groups from `bundle_ct_per_node_list` (bundles per virtual node)."""

    def __init__(
        self,
        bundle_ct_per_node_list: list[int],
        use_gpus: bool = False,
        num_gpus_per_bundle: float = 1.0,
        num_cpus_per_bundle: float = 1.0,
        name: str = "nexrl",
        placement_timeout_s: float = 60.0,
        node_resources: list[dict[str, float]] | None = None,
    ) -> None:
        if not bundle_ct_per_node_list or any(n < 0 for n in bundle_ct_per_node_list):
            raise ValueError(
                f"bundle_ct_per_node_list: non-negative counts, got {bundle_ct_per_node_list}"
            )
        if node_resources is not None and len(node_resources) != len(bundle_ct_per_node_list):
            raise ValueError(
                f"node_resources: one dict per node of {bundle_ct_per_node_list}, "
                f"got {len(node_resources)}"
            )
        self.bundle_ct_per_node_list = list(bundle_ct_per_node_list)
        self.node_resources = [dict(r or {}) for r in node_resources or []] or [
            {} for _ in bundle_ct_per_node_list
        ]
        self.bundle = {"CPU": float(num_cpus_per_bundle)}
        if use_gpus:
            self.bundle["GPU"] = float(num_gpus_per_bundle)
        # Named placement groups live as long as the Ray job: a unique suffix lets a
        # second run (or a restarted actor) in the same job place its own groups.
        self.name = f"{name}-{uuid.uuid4().hex[:8]}"
        self._groups: list[PlacementGroup | None] = []
        self._create(placement_timeout_s)

    def _create(self, timeout: float) -> None:
        for node, count in enumerate(self.bundle_ct_per_node_list):
            if count == 0:
                self._groups.append(None)
                continue
            bundle = {**self.bundle, **self.node_resources[node]}
            self._groups.append(
                placement_group(
                    [bundle] * count, strategy="STRICT_PACK", name=f"{self.name}-{node}"
                )
            )
        pending = [pg for pg in self._groups if pg is not None]
        ready, _ = ray.wait(
            [pg.ready() for pg in pending], num_returns=len(pending), timeout=timeout
        )
        if len(ready) < len(pending):
            message = self._missing_message(timeout)
            self.shutdown()
            raise PlacementGroupUnsatisfiable(message)

    def _missing_message(self, timeout: float) -> str:
        total = ray.cluster_resources()
        wanted: dict[str, float] = {}
        for count, extra in zip(self.bundle_ct_per_node_list, self.node_resources, strict=True):
            for key, value in {**self.bundle, **extra}.items():
                wanted[key] = wanted.get(key, 0.0) + value * count
        missing = {k: v - total.get(k, 0.0) for k, v in wanted.items() if v > total.get(k, 0.0)}
        per_node = max(self.bundle_ct_per_node_list)
        node_need = {k: v * per_node for k, v in self.bundle.items()}
        return (
            f"placement groups for bundles {self.bundle_ct_per_node_list} x {self.bundle} not "
            f"ready after {timeout:g} s: requested {wanted} in total ({node_need} on one node), "
            f"the cluster has {_pick(total, wanted)}, available now "
            f"{_pick(ray.available_resources(), wanted)}; missing {missing or 'none in total'}"
            + ("" if missing else " - no single node has enough, or other work holds them")
        )

    def get_placement_groups(self) -> list[PlacementGroup]:
        """The placement groups of nodes with at least one bundle."""
        return [pg for pg in self._groups if pg is not None]

    def node_ids(self) -> list[str]:
        """The Ray node (hex id) each virtual node with bundles landed on, in order."""
        from ray.util.placement_group import placement_group_table

        return [
            placement_group_table(pg)["bundles_to_node_id"][0] for pg in self.get_placement_groups()
        ]

    def bundle_locations(self) -> list[tuple[PlacementGroup, int]]:
        """(placement group, bundle index) of every bundle, in rank order."""
        return [(pg, i) for pg in self.get_placement_groups() for i in range(pg.bundle_count)]

    @property
    def world_size(self) -> int:
        return sum(self.bundle_ct_per_node_list)

    def shutdown(self) -> None:
        """Release the placement groups (workers on them are killed by Ray)."""
        for pg in self._groups:
            if pg is not None:
                remove_placement_group(pg)
        self._groups = []


def _pick(resources: Mapping[str, float], keys: Iterable[str]) -> dict[str, float]:
    return {k: float(resources.get(k, 0.0)) for k in keys}
