"""Ray for tests: one local 2-CPU Ray per session (`ray_local`), and a cluster of
simulated nodes on this machine (`SimulatedCluster`) for the multi-node tests.

The job's environment is the one `RaySystem` gives its actors (`actor_env`), so actors
reuse Ray's prestarted worker processes instead of starting fresh ones.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest


def start_local_ray() -> None:
    import ray

    from nexrl.distributed.settings import RaySettings, actor_env

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": actor_env(RaySettings())},
    )


@pytest.fixture(scope="session")
def ray_local():
    import ray

    started = not ray.is_initialized()
    if started:
        start_local_ray()
    yield ray
    if started and ray.is_initialized():
        ray.shutdown()


SIM_NODES: dict[str, float] = {"head": 1, "rollout": 2, "train": 2}
"""Simulated node -> its CPUs (what Ray schedules by; all share this machine's cores).
Each node also offers the custom resource `node_<name>` (100 units): a group pinned
with `resources: {node_train: 1}` can only run there."""


class SimulatedCluster:
    """Ray nodes on one machine (`ray.cluster_utils.Cluster`), each with its own temp
    dir (`<base>/<node>/ray`: sockets, logs, spilled objects) and its own private dir
    (`<base>/<node>/private`, in `NEXRL_SIM_NODE_DIR`), its name in `NEXRL_SIM_NODE`, and
    the file audit of `tests/file_audit.py` in every worker. The driver (this process)
    joins the head node."""

    def __init__(self, watched_root: Path) -> None:
        # AF_UNIX socket paths are limited to ~107 bytes: Ray's session folder goes under
        # each node's temp dir, so keep the base short
        self.base = Path(tempfile.mkdtemp(prefix="nxsim", dir="/tmp"))
        self.watched_root = Path(watched_root)
        self.audit_dir = self.base / "audit"
        self.audit_dir.mkdir()
        self.cluster: Any = None
        self._ray_tmpdir: str | None = None
        self.nodes: dict[str, Any] = {}

    def start(self) -> None:
        import ray
        from ray.cluster_utils import Cluster

        from nexrl.distributed.settings import QUIET_RAY_ENV, RaySettings, actor_env
        from tests import file_audit

        for name, value in QUIET_RAY_ENV.items():
            os.environ.setdefault(name, value)
        # the cluster's address file goes to $RAY_TMPDIR/ray, not the machine's /tmp/ray
        self._ray_tmpdir = os.environ.get("RAY_TMPDIR")
        os.environ["RAY_TMPDIR"] = str(self.base)
        (self.base / "ray").mkdir(exist_ok=True)
        audit = f"{self.watched_root}{os.pathsep}{self.audit_dir}"
        os.environ[file_audit.ENV_AUDIT] = audit
        self.cluster = Cluster()
        for name, cpus in SIM_NODES.items():
            private = self.base / name / "private"
            private.mkdir(parents=True, exist_ok=True)
            env = {file_audit.ENV_NODE: name, "NEXRL_SIM_NODE_DIR": str(private)}
            self.nodes[name] = self.cluster.add_node(
                num_cpus=cpus,
                resources={f"node_{name}": 100},
                temp_dir=str(self.base / name / "ray"),
                object_store_memory=200 << 20,
                env_vars=env,
                include_dashboard=False,
            )
        env_vars = {**actor_env(RaySettings()), file_audit.ENV_AUDIT: audit}
        ray.init(
            address=self.cluster.address,
            namespace="nexrl",
            log_to_driver=False,
            runtime_env={
                "env_vars": env_vars,
                "worker_process_setup_hook": "tests.file_audit.install",
            },
        )
        file_audit.install(node="head")  # the driver

    def node_id(self, name: str) -> str:
        return self.nodes[name].node_id

    def node_name(self, node_id: str) -> str:
        return next(n for n, node in self.nodes.items() if node.node_id == node_id)

    def remove(self, name: str) -> None:
        """The node leaves the cluster: its raylet and every worker on it are killed."""
        self.cluster.remove_node(self.nodes.pop(name), allow_graceful=False)

    def stop(self) -> None:
        """The whole cluster goes down (the private dirs and the output stay)."""
        import ray

        ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
        self.cluster, self.nodes = None, {}
        if self._ray_tmpdir is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = self._ray_tmpdir

    def close(self) -> None:
        from tests import file_audit

        self.stop()
        file_audit.uninstall()
        os.environ.pop(file_audit.ENV_AUDIT, None)
        shutil.rmtree(self.base, ignore_errors=True)


def simulated_cluster(watched_root: Path):
    """Generator for a module fixture: the session's local Ray is shut down for the
    cluster's lifetime and started again after it (other modules expect it)."""
    import ray

    had_local = ray.is_initialized()
    if had_local:
        ray.shutdown()
    sim = SimulatedCluster(watched_root)
    sim.start()
    try:
        yield sim
    finally:
        sim.close()
        if had_local:
            start_local_ray()
