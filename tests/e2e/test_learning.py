"""A short default run learns: validation reward rises above the untrained model's."""

import json
from pathlib import Path

import pytest

from nexrl.cli import main


@pytest.mark.slow
def test_short_default_run_improves_validation_reward(tmp_path):
    code = main(
        [
            "train",
            f"output_dir={tmp_path}",
            "train_worker.total_train_steps=60",
            "weight.validate_freq=30",
            "logger.backend=[jsonl]",
        ]
    )
    assert code == 0
    (metrics,) = Path(tmp_path).rglob("metrics.jsonl")
    val = [json.loads(line) for line in metrics.read_text().splitlines() if "val/reward" in line]
    assert [v["step"] for v in val] == [0, 30, 60]
    untrained, trained = val[0]["val/reward"], val[-1]["val/reward"]
    assert untrained < 0.1  # about chance
    assert trained > untrained + 0.05, val
