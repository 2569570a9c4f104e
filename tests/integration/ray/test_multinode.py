"""nexrl on a Ray cluster of three simulated nodes (head, rollout, train) on one machine.

One cluster for the module (`tests/ray_fixtures.py` `SimulatedCluster`): each node has
its own CPUs, its own Ray temp dir and a custom resource `node_<name>` that pins a
group to it (`ray.groups.<g>.resources`). The driver (this process) is on the head.

No shared disk is assumed, and the tests check it: every process of the cluster records
the file-system calls under the test's output folder with its node
(`tests/file_audit.py`, a Python audit hook), and no node may read, list or delete what
another node wrote. Weights and batches therefore travel in Ray calls (the object
store), checkpoints are written and found on the train node.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf, open_dict

from nexrl.config import load_config
from nexrl.controller import NexRLController, TrainingAborted
from nexrl.distributed.dp_train import RayDataParallelTrainClient
from nexrl.distributed.settings import ROLLOUT_TRAIN_COLOCATION, RaySettings, actor_env
from nexrl.distributed.virtual_cluster import RayVirtualCluster
from nexrl.distributed.worker_group import RayWorkerGroup
from nexrl.execute import execute
from nexrl.training.client import TrainServiceClient
from nexrl.training.synthetic import random_batch
from nexrl.types import NexRLRole
from tests import file_audit
from tests.ray_fixtures import simulated_cluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]

KW = {"clip_low": 0.2, "clip_high": 0.28, "agg_mode": "token-mean"}
PINNED = {
    "layout": "rollout_train",
    "groups": {
        "rollout": {"resources": {"node_rollout": 1}},
        "train": {"resources": {"node_train": 1}},
    },
}


@pytest.fixture(scope="module")
def watched(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("multinode")


@pytest.fixture(scope="module")
def sim(watched):
    yield from simulated_cluster(watched)


def pinned_config(out: Path, *overrides: str, ray: dict | None = None):
    cfg = load_config(
        [
            f"output_dir={out}",
            "launch_mode=ray",
            "logger.backend=[jsonl]",
            "ray.address=auto",  # ignored: the driver is already connected
            *overrides,
        ]
    )
    with open_dict(cfg):
        cfg.ray = OmegaConf.merge(cfg.ray, PINNED, ray or {})
    return cfg


def metrics(run_dir: str | Path) -> list[dict]:
    with file_audit.muted():
        text = (Path(run_dir) / "metrics.jsonl").read_text()
    return [json.loads(x) for x in text.splitlines()]


def checkpoints(folder: Path) -> list[str]:
    """The `global_step_N` folders (not a staging folder of a save the node loss cut)."""
    with file_audit.muted():  # the test looks; no node of the run does
        return sorted(p.name for p in folder.iterdir() if re.fullmatch(r"global_step_\d+", p.name))


def audit(sim) -> list[dict]:
    time.sleep(0.2)
    return file_audit.read_log(sim.audit_dir)


def test_the_audit_sees_a_file_read_on_another_node(sim, watched):
    """The detector itself: a file written by an actor on `train` and read by one on
    `rollout` is reported; the same read on `train` is not."""
    import ray

    @ray.remote(num_cpus=0)
    class Files:
        def write(self, path: str) -> None:
            Path(path).write_text("weights")

        def read(self, path: str) -> str:
            return Path(path).read_text()

    on_train = Files.options(resources={"node_train": 1}).remote()
    on_rollout = Files.options(resources={"node_rollout": 1}).remote()
    path = str(watched / "probe" / "w.txt")
    Path(path).parent.mkdir()
    ray.get(on_train.write.remote(path))
    assert ray.get(on_train.read.remote(path)) == "weights"
    assert file_audit.cross_node_accesses(audit(sim)) == []
    ray.get(on_rollout.read.remote(path))
    assert file_audit.cross_node_accesses(audit(sim)) == [
        f"read of {path} on rollout, written on ['train']"
    ]
    ray.kill(on_train)
    ray.kill(on_rollout)
    for log in sim.audit_dir.iterdir():  # start the runs below from a clean record
        log.unlink()


def test_the_default_recipe_learns_across_three_nodes_without_a_shared_disk(sim, watched):
    """The default run (the bar of tests/e2e/test_learning.py: 60 steps, validation reward
    above the untrained model's), with the rollout and train groups on their nodes."""
    out = watched / "default"
    ckpt = watched / "train_disk" / "ckpt"  # where the user points: the train node's disk
    controller = NexRLController(
        pinned_config(
            out,
            "train_worker.total_train_steps=60",
            "weight.validate_freq=30",
            "train_worker.save_freq=30",
            f"train_worker.checkpoint_path={ckpt}",
        )
    )
    try:
        manager = controller.system.resource_manager
        where = {g: sim.node_name(n) for g, n in controller.system.placement.items()}
        roles = {role.value: where[manager.group_of(role)] for role in NexRLRole}
        final = controller.run()
    finally:
        controller.system.shutdown()
    assert where == {"rollout": "rollout", "train": "train"}
    assert roles == ROLLOUT_TRAIN_COLOCATION  # every role on the node named like its group
    val = [x for x in metrics(controller.run_dir) if "val/reward" in x]
    assert [v["step"] for v in val] == [0, 30, 60]
    assert val[0]["val/reward"] < 0.1 and val[-1]["val/reward"] > val[0]["val/reward"] + 0.05
    assert final["val/reward"] == val[-1]["val/reward"]
    rows = audit(sim)
    assert file_audit.cross_node_accesses(rows) == []
    assert file_audit.nodes_that_wrote(rows, ckpt) == {"train"}
    assert file_audit.nodes_that_wrote(rows, Path(controller.run_dir) / "metrics.jsonl") == {"head"}
    # the weights crossed inside the push calls: no file under sync_weights, anywhere
    assert file_audit.nodes_that_wrote(rows, Path(controller.run_dir) / "sync_weights") == set()
    assert checkpoints(ckpt) == ["global_step_30", "global_step_60"]  # the newest, the fallback


class Probe:
    """A worker's view of its place in the group."""

    def env(self) -> dict[str, str]:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")
        return {k: os.environ[k] for k in (*keys, "MASTER_ADDR", "MASTER_PORT", "NEXRL_SIM_NODE")}


def test_a_worker_group_spans_two_nodes_with_ranks_by_node(sim):
    """Seed 002: `bundle_ct_per_node_list=[2, 1]`, node 0 pinned to `rollout`, node 1 to
    `train`: ranks count node by node, LOCAL_RANK restarts per node, one rendezvous."""
    pins = [{"node_rollout": 1}, {"node_train": 1}]
    cluster = RayVirtualCluster([2, 1], num_cpus_per_bundle=0.2, node_resources=pins)
    group = RayWorkerGroup(cluster, Probe)
    try:
        envs = group.get_results(group.run_all_workers_single_data("env"))
        nodes = [sim.node_name(n) for n in cluster.node_ids()]
    finally:
        group.shutdown()
        cluster.shutdown()
    assert nodes == ["rollout", "train"]
    assert [e["NEXRL_SIM_NODE"] for e in envs] == ["rollout", "rollout", "train"]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0"]
    assert [e["LOCAL_WORLD_SIZE"] for e in envs] == ["2", "2", "1"]
    assert [e["NODE_RANK"] for e in envs] == ["0", "0", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1


def test_two_data_parallel_ranks_on_two_nodes_equal_one_engine(sim, tiny_model_path):
    """Gloo between the `rollout` and `train` nodes; the same check as the one-node test
    in tests/unit/distributed/test_worker_group.py."""
    engine_cfg = {"micro_batch_tokens": 1, "lr": 1e-3, "seed": 0}
    single = TrainServiceClient({}, engine_cfg, tiny_model_path)
    single.initialize()
    dp = RayDataParallelTrainClient(
        {},
        engine_cfg,
        tiny_model_path,
        bundles_per_node=[1, 1],
        num_cpus_per_bundle=0.2,
        env_vars=actor_env(RaySettings()),
        node_resources=[{"node_rollout": 1}, {"node_train": 1}],
    )
    dp.initialize()
    try:
        assert dp.cluster is not None
        assert [sim.node_name(n) for n in dp.cluster.node_ids()] == ["rollout", "train"]
        batch = random_batch(7, 12, seed=20)  # shards of 3 and 4 rows
        old = single.compute_logprobs(batch)
        torch.testing.assert_close(dp.compute_logprobs(batch), old, atol=1e-6, rtol=1e-5)
        batch.values["old_logprobs"] = old
        m_one = single.train_batch(batch, "ppo_clip", KW)
        m_dp = dp.train_batch(batch, "ppo_clip", KW)
        for key in ("loss", "grad_norm", "tokens", "num_seqs"):
            assert m_dp[key] == pytest.approx(m_one[key], rel=1e-5, abs=1e-7), key
        weights = dp.export_weights()
        for name, p in single.export_weights().items():  # 5% of lr: see the one-node test
            torch.testing.assert_close(weights[name], p, atol=5e-5, rtol=1e-5)
    finally:
        dp.close()


SHORT = (
    "rollout_worker.group_size=4",
    "rollout_worker.max_tokens=4",
    "rollout_worker.num_workers=2",
    "trajectory_pool.batch_size=16",
    "weight.validate_freq=0",
    "validate.validate_before_train=false",
    "train_worker.save_freq=2",
)


def test_a_lost_node_stops_the_run_and_the_restarted_cluster_resumes(sim, watched):
    """The train node leaves the cluster at step 3: the run stops naming the node, the
    actor group it held and how to continue (nexrl/distributed/nodes.py says why it does
    not re-place the actors). Its checkpoints (every 2 steps) are where the user pointed,
    on the train node's disk. The whole cluster goes down and comes back (new Ray
    sessions, the nodes' disks kept); `resume.mode=auto` continues from the last
    checkpoint, which the driver finds through the train node."""
    ckpt = watched / "train_disk" / "resume"
    run = [f"train_worker.checkpoint_path={ckpt}", "resume.mode=auto", *SHORT]
    first = NexRLController(
        pinned_config(
            watched / "r1",
            "train_worker.total_train_steps=200",
            "runtime_monitor.health_check.check_interval=1.0",
            *run,
        )
    )
    train_node = sim.node_id("train")

    removed_at: list[float] = []

    def remove_at_step_3() -> None:
        while execute(first.system.train_workers[0].get_train_step) < 3:
            time.sleep(0.05)
        removed_at.append(time.monotonic())
        sim.remove("train")

    killer = threading.Thread(target=remove_at_step_3, daemon=True)
    killer.start()
    try:
        with pytest.raises(TrainingAborted) as err:
            first.run()
    finally:
        first.system.shutdown()
    killer.join(timeout=10)
    stopped_s = time.monotonic() - removed_at[0]
    message = str(err.value)
    assert re.search(rf"node {train_node[:12]} \(\S+, resources \['node_train'\]\)", message)
    assert "actor(s) ['train']" in message and "resume.mode=auto" in message
    assert str(ckpt) in message
    saved = checkpoints(ckpt)  # the newest and, once there is one, the fallback before it
    assert 1 <= len(saved) <= 2
    step = max(int(name.removeprefix("global_step_")) for name in saved)
    assert step >= 2 and step % 2 == 0

    sim.stop()
    sim.start()
    total = f"train_worker.total_train_steps={step + 2}"
    second = NexRLController(pinned_config(watched / "r2", total, *run))
    try:
        second.run()
    finally:
        second.system.shutdown()
    trained = [x["step"] for x in metrics(second.run_dir) if "train/loss" in x]
    assert trained == [step + 1, step + 2]
    assert set(checkpoints(ckpt)) == {f"global_step_{step}", f"global_step_{step + 2}"}
    rows = audit(sim)
    assert file_audit.cross_node_accesses(rows) == []
    assert file_audit.nodes_that_wrote(rows, ckpt) == {"train"}
    print(f"multinode: the run stopped {stopped_s:.1f} s after the node was removed")
