"""Each sync mode end to end on the tiny model: bound kept, versions logged, ledger closed."""

import json
import sys
from pathlib import Path

import pytest

from nexrl.controller import NexRLController
from nexrl.execute import execute
from nexrl.training.parallel import free_port
from nexrl.types import Task
from tests.servers import spawn

MODES = {
    "sync": [],
    "batch-async": ["weight.sync_mode=batch-async", "weight.staleness_threshold=1"],
    "fully-async": ["weight.sync_mode=fully-async", "weight.staleness_threshold=1"],
    "fully-async-partial": [
        "weight.sync_mode=fully-async",
        "weight.staleness_threshold=1",
        "weight.enable_partial_rollout=true",
        "weight.over_sample_threshold=0.5",
        "weight.abort_grace_s=0",  # pushes abort at once: the partial path runs
    ],
    "fully-async-inflight": [
        "weight.sync_mode=fully-async",
        "weight.staleness_threshold=1",
        "weight.inflight_weight_update=true",
    ],
}

ABORTING = [  # pushes abort running requests, and every push meets some
    *MODES["fully-async"],
    "weight.inflight_weight_update=false",
    "+service.inference_service.engine.emulated_step_latency_s=0.01",
    "service.inference_service.engine.max_batch_size=32",
    "rollout_worker.max_tokens=16",
]


def train_lines(run_dir):
    lines = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if "train/loss" in x]


def queued_tasks(system) -> int:
    """Tasks still waiting somewhere: loader returns, pools, tail candidates."""
    loader = system.dataloader
    returned = sum(1 for t in execute(loader.returned_items) if isinstance(t, Task))
    group = execute(system.trajectory_pool.num_ready) // 4
    batches = execute(system.train_batch_pool.qsize) * 2  # 8 / group_size 4 = 2 groups
    state = execute(system.task_admission.snapshot, "default")
    return returned + group + batches + state["tail_candidates"]


@pytest.mark.parametrize("mode", list(MODES))
def test_mode_keeps_the_bound_and_the_ledger(async_config, mode):
    controller = NexRLController(async_config(*MODES[mode]))
    controller.run()
    check_run(controller, mode)


def test_aborts_and_tail_batches_keep_the_bound_and_the_ledger(async_config):
    """A slowed engine (the emulated-accelerator config key) makes every push find running
    requests: aborts, continuations, tail candidates, all inside a real run."""
    extra = [
        *MODES["fully-async-partial"],
        "+service.inference_service.engine.emulated_step_latency_s=0.01",
        "service.inference_service.engine.max_batch_size=32",
        "rollout_worker.max_tokens=16",
        "weight.tail_batch_candidate_steps=1",
        "weight.tail_batch_trigger_size=1",
    ]
    controller = NexRLController(async_config(*extra))
    controller.run()
    check_run(controller, "fully-async-partial")
    counters = controller.activity_tracker.get_counters()
    assert counters["rollout/aborted_groups"] > 0
    assert counters["rollout/partial_continuations"] > 0


@pytest.mark.parametrize("partial", [None, False])
def test_aborting_pushes_continue_samples_unless_partial_rollout_is_off(async_config, partial):
    """In-flight updates off: pushes abort running requests. By default the aborted
    samples go on from their tokens (partial rollout); with it set to false the task is
    re-queued and starts over."""
    extra = [
        *ABORTING,
        "weight.abort_grace_s=0",
    ]
    if partial is not None:
        extra.append(f"weight.enable_partial_rollout={str(partial).lower()}")
    controller = NexRLController(async_config(*extra))
    controller.run()
    check_run(controller, "fully-async")
    counters = controller.activity_tracker.get_counters()
    assert counters["rollout/aborted_groups"] > 0
    continued = counters.get("rollout/partial_continuations", 0)
    assert continued > 0 if partial is None else continued == 0


def test_a_grace_lets_running_rollouts_finish_before_an_aborting_push(async_config):
    """`weight.abort_grace_s`: a push first waits for the running rollouts (none start
    meanwhile); with a grace longer than any generation nothing is aborted or redone."""
    extra = [*ABORTING, "weight.enable_partial_rollout=false", "weight.abort_grace_s=30"]
    controller = NexRLController(async_config(*extra))
    controller.run()
    check_run(controller, "fully-async")
    counters = controller.activity_tracker.get_counters()
    assert counters.get("rollout/aborted_groups", 0) == 0
    assert counters.get("rollout/partial_continuations", 0) == 0


def test_inflight_updates_reach_running_requests_without_aborts(async_config):
    """Pushes swap the weights under running requests: nothing is aborted, and samples
    that were running during a push carry two versions in `token_versions`."""
    extra = [
        *MODES["fully-async-inflight"],
        "rollout_worker.max_tokens=16",
        "+service.inference_service.engine.emulated_step_latency_s=0.01",
        "service.inference_service.engine.max_batch_size=32",
        "+service.inference_service.engine.gather_quiet_s=0.001",
        "+service.inference_service.engine.gather_max_s=0.005",
    ]
    controller = NexRLController(async_config(*extra))
    controller.run()
    check_inflight_run(controller)


def check_inflight_run(controller) -> list[dict]:
    """Bound and ledger kept, no abort, some sample spans two versions; returns train lines."""
    check_run(controller, "fully-async-inflight")
    assert controller.activity_tracker.get_counters().get("rollout/aborted_groups", 0) == 0
    lines = train_lines(controller.run_dir)
    assert any(x["rollout/multi_version_frac"] > 0 for x in lines)
    return lines


def check_run(controller, mode):
    k = controller._config.weight.staleness_threshold
    lines = train_lines(controller.run_dir)
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    assert all(x["staleness/max"] <= k for x in lines), [x["staleness/max"] for x in lines]
    assert all("rollout/serving_version" in x and "staleness/dropped" in x for x in lines)
    if mode == "sync":  # on-policy, plain GRPO
        assert all(x["staleness/max"] == 0 and "train/is_weight_mean" not in x for x in lines)
    else:  # the off-policy correction is on by default
        assert all("train/is_weight_mean" in x for x in lines)
    counters = controller.activity_tracker.get_counters()
    trained = counters.get("tasks_trained", 0)
    assert trained == 4 * 2
    dropped = counters.get("groups_dropped/dynamic_sampling", 0)
    failed = counters.get("tasks_failed/train", 0)
    assert counters["tasks_in/train"] == trained + dropped + failed + queued_tasks(
        controller.system
    ), counters


@pytest.mark.slow
def test_inflight_updates_through_a_served_engine(async_config, tiny_model_path):
    """The same in-flight run against `nexrl serve` in its own process: pushes go through
    /update_weights_from_disk and still land between two decode steps of running requests."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "nexrl.cli", "serve", "--model", tiny_model_path]
    cmd += ["--port", str(port), "--max-batch", "32", "--emulated-step-latency", "0.01"]
    server = spawn(cmd, url)
    try:
        extra = [
            *MODES["fully-async-inflight"],
            "rollout_worker.max_tokens=16",
            "service.inference_service.backend=remote",
            f"service.inference_service.url={url}",
        ]
        controller = NexRLController(async_config(*extra))
        controller.run()
    finally:
        server.terminate()
        server.wait(30)
    lines = check_inflight_run(controller)
    assert lines[-1]["rollout/serving_version"] >= 3  # every push reached the server
