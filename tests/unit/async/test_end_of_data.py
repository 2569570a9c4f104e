"""The end of a finite dataset whose size is not a multiple of the batch.

Before the fix a run with `check_batch_ready_function=batch_size` never ended: the
last groups could not fill a batch and the controller waited for an empty pool.
Now the remainder is dropped and counted (`batch_size`) or trained as a smaller
final batch (`loaded_batch_finished`), in every sync mode, and the ledger closes:
`tasks_in/train = tasks_trained + groups_dropped/end_of_data`.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from nexrl.config import load_config
from nexrl.controller import NexRLController
from nexrl.data.base import InMemoryDataLoader
from nexrl.rollout.admission import GroupInfo, TaskAdmission
from nexrl.rollout.sample_policy import SamplePolicy
from nexrl.types import StepResult

TAG = "default"
ITEMS = 18  # 4 batches of 4 groups, 2 groups left over


def test_end_of_data_waits_for_every_handed_out_task_then_drops_are_settled():
    loader = InMemoryDataLoader(items=[{"prompt": f"p{i}"} for i in range(3)])
    admission = TaskAdmission(SamplePolicy(), max_task_retries=0)
    admission.set_module_references(loader)
    tasks = [admission.acquire(TAG) for _ in range(3)]
    assert loader.is_finished() and not admission.end_of_data(TAG)  # all three generating
    admission.complete(TAG, tasks[0], StepResult.SUCCESS)
    admission.complete(TAG, tasks[1], StepResult.SUCCESS)
    assert not admission.end_of_data(TAG)  # tasks[2] still generating
    admission.complete(TAG, tasks[2], StepResult.ABORTED)  # back to the loader
    assert not admission.end_of_data(TAG)
    again = admission.acquire(TAG)
    admission.complete(TAG, again, StepResult.SUCCESS)
    assert admission.end_of_data(TAG)
    groups = [GroupInfo(t.task_id, None) for t in (tasks[0], tasks[1], again)]
    assert admission.drop_groups(TAG, groups, "end_of_data") == 3
    assert admission.pending_count() == 0  # settled: nothing left for a checkpoint


FULLY_ASYNC = ["weight.sync_mode=fully-async", "weight.staleness_threshold=1"]
RUNS = {  # name: (mode overrides, check_batch_ready_function, train steps)
    "fully-async, drop": (FULLY_ASYNC, "batch_size", 4),
    "sync, drop": (["weight.sync_mode=sync"], "batch_size", 4),
    "fully-async, final batch": (FULLY_ASYNC, "loaded_batch_finished", 5),
    "sync, final batch": (["weight.sync_mode=sync"], "loaded_batch_finished", 5),
}


@pytest.mark.timeout(90)  # before the fix the "drop" runs never returned
@pytest.mark.parametrize("name", list(RUNS))
def test_a_run_over_a_dataset_not_a_multiple_of_the_batch_ends(tmp_path, tiny_model_path, name):
    mode, rule, steps = RUNS[name]
    cfg = load_config(
        [
            f"output_dir={tmp_path / 'out'}",
            f"model_path={tiny_model_path}",
            f"data.max_items={ITEMS}",
            "data.num_epochs=1",
            "rollout_worker.group_size=4",
            "rollout_worker.max_tokens=4",
            "rollout_worker.num_workers=2",
            "trajectory_pool.batch_size=16",
            f"trajectory_pool.check_batch_ready_function={rule}",
            "train_worker.save_freq=0",
            "train_worker.log_trained_uids=true",
            "weight.validate_freq=0",
            "validate.validate_before_train=false",
            "validate.data.max_items=4",
            "logger.backend=[jsonl]",
            *mode,
        ]
    )
    controller = NexRLController(cfg)
    controller.run()
    counters = controller.activity_tracker.get_counters()
    rows = [json.loads(x) for x in (Path(controller.run_dir) / "trained.jsonl").open()]
    uids = Counter(uid for row in rows for uid in row["uids"])
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    assert max(uids.values()) == 1  # nothing trained twice
    dropped = counters.get("groups_dropped/end_of_data", 0)
    assert (len(uids), dropped) == ((ITEMS, 0) if steps == 5 else (16, 2))
    assert counters["tasks_in/train"] == ITEMS == counters["tasks_trained"] + dropped
