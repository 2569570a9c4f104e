"""Where a Ray run's actors live, per node: work on a given node, and lost nodes.

Nothing in a multi-node run may assume a shared disk (docs/ray.md, "A multi-node
cluster"). Files are read on the node that wrote them: checkpoints are written and
read by the train worker, so the controller (the driver, on the head node) finds the
newest checkpoint with a task on the train worker's node (`run_on_node`), not by
listing a folder it may not have.

A node that leaves the cluster takes its actors and its disk with it. nexrl does not
re-place them on the remaining nodes: the actors are pinned there by their resources
(GPUs, `ray.groups.<g>.resources`), and without a shared disk the last checkpoint was
on the train node's disk. `lost_nodes_message` names the node, what ran there and what
to do instead (tests/integration/ray/test_multinode.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

_R = TypeVar("_R")


def run_on_node(node_id: str, fn: Callable[..., _R], *args: object, timeout: float = 600.0) -> _R:
    """`fn(*args)` in a Ray task on node `node_id` (hex); fails if that node is gone."""
    task = ray.remote(_call).options(
        num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        max_retries=0,
    )
    result: _R = ray.get(task.remote(fn, *args), timeout=timeout)
    return result


def _call(fn: Callable[..., _R], *args: object) -> _R:
    return fn(*args)


def this_node() -> str:
    """The Ray node id of this process (the driver's: the head node, or where it runs)."""
    return ray.get_runtime_context().get_node_id()


def pinned_here() -> NodeAffinitySchedulingStrategy:
    """Schedule on this process's node: the activity tracker writes the run's metrics
    and logs next to the driver's `config.yaml`, on one node's disk."""
    return NodeAffinitySchedulingStrategy(this_node(), soft=False)


def node_table() -> dict[str, dict[str, Any]]:
    """Node id -> Ray's record (`Alive`, `NodeManagerAddress`, `Resources`, ...)."""
    return {node["NodeID"]: node for node in ray.nodes()}


def lost_nodes_message(
    placement: dict[str, str], checkpoint_path: str, known: dict[str, dict] | None = None
) -> str | None:
    """None while every node in `placement` (actor group -> node id) is alive; else a
    message naming each lost node, the groups it ran, and what to do. `known`: the
    `node_table()` of the run's start (Ray forgets a dead node's resources)."""
    table = node_table()
    lost: dict[str, list[str]] = {}
    for group, node in placement.items():
        if not table.get(node, {}).get("Alive", False):
            lost.setdefault(node, []).append(group)
    if not lost:
        return None
    parts = []
    for node, groups in lost.items():
        record = {**table.get(node, {}), **(known or {}).get(node, {})}
        custom = sorted(
            k
            for k in record.get("Resources", {})
            if k not in ("CPU", "GPU", "memory")
            and not k.startswith(("node:", "object_store_memory", "accelerator_type"))
        )
        parts.append(
            f"node {node[:12]} ({record.get('NodeManagerAddress', '?')}"
            + (f", resources {custom}" if custom else "")
            + f") left the Ray cluster with the actor(s) {sorted(groups)}"
        )
    return (
        "; ".join(parts)
        + ". Their state is lost and nexrl does not move pinned actors to other nodes: "
        "bring the node back (or add one with the same resources), then run the same "
        f"command with resume.mode=auto to continue from the last checkpoint under "
        f"{checkpoint_path} (on the train worker's node)"
    )


def wait_for_lost_nodes(
    actors: dict[str, Any],
    placement: dict[str, str],
    checkpoint_path: str,
    known: dict[str, dict] | None = None,
    wait_s: float = 60.0,
) -> str | None:
    """`lost_nodes_message`, after waiting while an actor is unreachable but its node is
    not yet reported dead (Ray notices a crashed node after its health checks fail,
    seconds after the first call to it fails). None when no node of the run was lost."""
    deadline = time.monotonic() + wait_s
    while True:
        message = lost_nodes_message(placement, checkpoint_path, known)
        if message is not None:
            return message
        waiting = any(_unreachable(actor) for actor in actors.values())
        if not waiting or time.monotonic() > deadline:
            return lost_nodes_message(placement, checkpoint_path, known)
        time.sleep(0.5)


def _unreachable(actor: Any) -> bool:
    """The actor does not answer and Ray cannot say it died (its node may be gone)."""
    try:
        ray.get(actor.ping.remote(), timeout=5.0)
    except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
        return True
    except ray.exceptions.RayActorError:  # dead, and Ray knows why
        return False
    return False
