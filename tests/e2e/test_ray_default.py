"""The default run in Ray mode reaches the same reward bar as local mode (issue: Ray mode)."""

import json
from pathlib import Path

import pytest

from nexrl.cli import main


@pytest.mark.ray
@pytest.mark.slow
def test_default_run_on_local_ray_reaches_the_reward_bar(tmp_path):
    code = main(["train", "launch_mode=ray", f"output_dir={tmp_path}", "logger.backend=[jsonl]"])
    assert code == 0
    (metrics,) = Path(tmp_path).rglob("metrics.jsonl")
    val = [json.loads(line) for line in metrics.read_text().splitlines() if "val/reward" in line]
    assert val[0]["step"] == 0 and val[0]["val/reward"] < 0.1
    assert val[-1]["step"] == 500 and val[-1]["val/reward"] >= 0.9, val[-1]
