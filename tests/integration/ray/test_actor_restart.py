"""A Ray module actor killed with SIGKILL mid-run is restarted and the ledger still balances.

A fully-async run (staleness 1: tasks are generating, pooled and in formed
batches at every moment) over a finite dataset, checkpointing every 2 steps
(so a rewind redoes trained steps), with
`max_restarts` on the `rollout` actor (rollout workers, the weight-sync
controller and its task ledger, the engine), the `data` actor (loader, pools;
the three-actor `SPLIT_COLOCATION` layout, so each kind of state is lost alone)
and the `train` actor (weights, optimizer). The test kills each actor's process
in turn, a random fraction of a step after a step ends, and waits for the rewind
before the next kill. Each restart rewinds the run to its last checkpoint
(nexrl/distributed/recovery.py); `train_worker.log_trained_uids` records what
every step trained, a rewind to step s discards the lines of steps after s, and
what is left must be each item of the dataset exactly once.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict

from nexrl.config import load_config
from nexrl.controller import NexRLController
from nexrl.distributed.settings import SPLIT_COLOCATION
from nexrl.execute import execute

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ITEMS = 64  # 16 steps of 4 groups
KILLS = (("rollout", 3), ("data", 3), ("train", 3))  # (group, steps after the last rewind)
JITTER_S = 0.3  # the kill lands anywhere in the next step: generating, saving, pushing


def restart_config(tmp_path: Path, tiny_model_path: str):
    cfg = load_config(
        [
            f"output_dir={tmp_path / 'out'}",
            f"model_path={tiny_model_path}",
            "launch_mode=ray",
            f"data.max_items={ITEMS}",
            "data.num_epochs=1",
            "rollout_worker.group_size=4",
            "rollout_worker.max_tokens=4",
            "rollout_worker.num_workers=2",
            "trajectory_pool.batch_size=16",
            "weight.sync_mode=fully-async",
            "weight.staleness_threshold=1",
            "weight.validate_freq=0",
            "validate.validate_before_train=false",
            "train_worker.save_freq=2",
            "train_worker.remove_previous_ckpt=true",
            "train_worker.log_trained_uids=true",
            "logger.backend=[jsonl]",
        ]
    )
    with open_dict(cfg):
        groups = {group: {"max_restarts": 1} for group, _ in KILLS}
        cfg.ray = OmegaConf.merge(cfg.ray, {"groups": groups, "colocation": SPLIT_COLOCATION})
    return cfg


def kill_in_turn(controller: NexRLController, done: list[tuple[str, int]]) -> threading.Thread:
    """SIGKILL each actor of `KILLS` once training is `after` steps past the last rewind
    (or the start), and wait for its rewind before the next kill."""
    import ray

    rng = random.Random(15)

    def train_step() -> int:
        return execute(controller.system.train_workers[0].get_train_step)

    def run() -> None:
        for group, after in KILLS:
            base = controller.rewinds[-1][0] if controller.rewinds else 0
            seen = len(controller.rewinds)
            while train_step() < base + after:
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, JITTER_S))
            actor = controller.system.resource_manager.actors[group]
            pid, step = ray.get(actor.pid.remote()), train_step()
            os.kill(pid, signal.SIGKILL)
            done.append((group, step))
            while len(controller.rewinds) == seen:
                time.sleep(0.05)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def trained_once_per_rewind(path: Path) -> tuple[dict[int, list[str]], list[int]]:
    """step -> uids after discarding what each rewind redid; and the rewind steps seen."""
    trained: dict[int, list[str]] = {}
    rewinds = []
    for row in map(json.loads, path.read_text().splitlines()):
        redone = [s for s in trained if s >= row["step"]]
        if redone:
            rewinds.append(row["step"] - 1)
        for step in redone:
            del trained[step]
        trained[row["step"]] = row["uids"]
    return trained, rewinds


@pytest.mark.timeout(240)
def test_killed_actors_restart_and_every_item_is_trained_exactly_once(
    ray_local, tmp_path, tiny_model_path
):
    t0 = time.monotonic()
    controller = NexRLController(restart_config(tmp_path, tiny_model_path))
    kills: list[tuple[str, int]] = []
    killer = kill_in_turn(controller, kills)
    try:
        controller.run()
        counters = execute(controller.activity_tracker.get_counters)
    finally:
        controller.system.shutdown()
    killer.join(timeout=5)
    trained, rewinds = trained_once_per_rewind(Path(controller.run_dir) / "trained.jsonl")
    counts = Counter(uid for uids in trained.values() for uid in uids)
    dataset = {f"0-{i}" for i in range(ITEMS)}
    lost = sorted(dataset - set(counts))
    duplicated = sorted(uid for uid, n in counts.items() if n > 1)
    print(
        "actor-restart figures:",
        {
            "kills": kills,
            "rewinds": controller.rewinds,
            "lost": len(lost),
            "duplicated": len(duplicated),
            "steps_redone": counters.get("recovery/steps_redone", 0),
            "seconds": round(time.monotonic() - t0, 1),
        },
    )
    assert [group for group, _ in kills] == [group for group, _ in KILLS]
    assert [groups for _, groups in controller.rewinds] == [[g] for g, _ in KILLS]
    assert counters["recovery/rewinds"] == len(KILLS)
    assert not lost, f"{len(lost)} items never trained: {lost}"
    assert not duplicated, f"{len(duplicated)} items trained twice: {duplicated}"
    assert sorted(trained) == list(range(1, ITEMS // 4 + 1))
    assert all(step in [s for s, _ in controller.rewinds] for step in rewinds)
