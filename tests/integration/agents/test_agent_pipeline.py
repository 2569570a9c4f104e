"""`rollout_worker.type=agent` end to end: a multi-turn workflow trains in sync and
fully-async mode (staleness 1) on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nexrl.controller import NexRLController
from nexrl.rollout.agent import AgentRolloutWorker
from nexrl.types import Task
from tests.integration.agents import workflows

MODES = {
    "sync": [],
    "fully-async": ["weight.sync_mode=fully-async", "weight.staleness_threshold=1"],
}


def train_lines(run_dir):
    lines = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if "train/loss" in x]


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_multi_turn_workflow_trains(agent_config, mode):
    workflows.SEEN.clear()
    controller = NexRLController(agent_config(*MODES[mode]))
    assert all(isinstance(w, AgentRolloutWorker) for w in controller.system.rollout_workers)
    controller.run()
    lines = train_lines(controller.run_dir)
    assert [x["step"] for x in lines] == [1, 2, 3]
    k = 0 if mode == "sync" else 1
    assert all(x["staleness/max"] <= k for x in lines)
    counters = controller.activity_tracker.get_counters()
    assert counters.get("tasks_trained", 0) == 3 * 2
    # every trajectory has two policy turns around a masked nudge (as the workflow built it)
    assert workflows.SEEN
    for t in workflows.SEEN:
        mask = t["loss_mask"]
        assert mask[0] == 1 and mask[-1] == 1 and 0 in mask
        assert all((v >= 0) == bool(m) for v, m in zip(t["token_versions"], mask, strict=True))
    assert max(v for t in workflows.SEEN for v in t["token_versions"]) >= 2  # pushes served


def test_rejecting_workflow_drops_tasks(agent_config):
    cfg = agent_config(
        "rollout_worker.workflow=tests.integration.agents.workflows:RejectAll",
        "rollout_worker.num_workers=1",
    )
    controller = NexRLController(cfg)
    worker = controller.system.rollout_workers[0]
    assert worker.step(Task(data={"uid": 1, "prompt": "abc"})) == "dropped"


def test_bad_workflow_path_names_the_key(agent_config):
    with pytest.raises(ValueError, match="rollout_worker.workflow='nope:Missing'"):
        NexRLController(agent_config("rollout_worker.workflow=nope:Missing"))


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.mark.slow
def test_tool_workflow_trains_multi_turn(agent_config, model_path):
    """The built-in ToolWorkflow in a real run: the scripted model calls `add` every turn
    (greedy), so each episode is two policy turns around a masked tool result."""
    cfg = agent_config(
        f"model_path={model_path}",
        "rollout_worker.workflow=tests.integration.agents.workflows:RecordingToolWorkflow",
        "+rollout_worker.workflow_kwargs.tools=[tests.integration.agents.test_agent_pipeline:add]",
        "+rollout_worker.workflow_kwargs.max_turns=2",
        "rollout_worker.max_tokens=16",
        "rollout_worker.temperature=0",
    )
    workflows.SEEN.clear()
    controller = NexRLController(cfg)
    controller.run()
    lines = train_lines(controller.run_dir)
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert workflows.SEEN
    for t in workflows.SEEN:
        assert t["agent_metrics"]["agent/tool_calls"] == 1 and t["agent_finish"] == "max_turns"
        assert sum(t["loss_mask"]) == 8 and 0 in t["loss_mask"]
