"""Seed 004's dataset section as run config: `data.name` (the dataset's configuration,
as `datasets.load_dataset(path, name=...)`) and `data.map_fn` (a `module:function`
applied to each row with its index), through a real `nexrl train` run on `openai/gsm8k`
read from the offline datasets cache (the fixture of test_seed004_main)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import nexrl
from nexrl.config.schema import DataConfig
from nexrl.data import HFDataLoader, InMemoryDataLoader
from tests.seeds.test_seed004_main import GSM8K, gsm8k_cache  # noqa: F401  (fixture)

REPO = Path(nexrl.__file__).resolve().parents[1]


def process_example(example, idx):
    """The seed's `process_example`: a query id and the prompt column from the question."""
    example["query_id"] = str(idx)
    example["prompt"] = example["question"]
    example["method"] = "math"
    return example


def broken_example(example, idx):
    if idx == 2:
        raise KeyError("solution")
    return example


def config(**kw) -> DataConfig:
    return DataConfig(**{"path": "openai/gsm8k", "name": "main", "shuffle": False, **kw})


@pytest.mark.usefixtures("gsm8k_cache")
def test_the_loaders_read_the_named_configuration_and_map_each_row():
    loader = HFDataLoader(config(map_fn=f"{__name__}:process_example"))
    rows = [loader.get_next_item() for _ in range(4)]
    assert [r["prompt"] for r in rows] == GSM8K["question"]
    assert [r["query_id"] for r in rows] == ["0", "1", "2", "3"]
    memory = InMemoryDataLoader(config(map_fn=f"{__name__}:process_example", max_items=2))
    assert [memory.get_next_item()["prompt"] for _ in range(2)] == GSM8K["question"][:2]
    assert memory.get_next_item() is None


@pytest.mark.usefixtures("gsm8k_cache")
def test_bad_name_and_map_fn_fail_in_one_line_naming_the_key():
    with pytest.raises(ValueError, match=r"data.path 'openai/gsm8k' \(data.name='nope'") as e:
        HFDataLoader(config(name="nope"))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^data.map_fn: .* has no function 'missing'"):
        HFDataLoader(config(map_fn=f"{__name__}:missing"))
    with pytest.raises(ValueError, match=r"data.map_fn '.*:broken_example' failed on row 2"):
        HFDataLoader(config(map_fn=f"{__name__}:broken_example"))
    # without the map the rows have no `prompt`: the check names the key
    with pytest.raises(ValueError, match=r"missing key 'prompt' \(data.prompt_key\)"):
        HFDataLoader(config())


def test_name_on_a_single_file_is_refused(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "abcd>"}) + "\n")
    with pytest.raises(ValueError, match=r"validate.data.name='main' .* is a file"):
        HFDataLoader(DataConfig(path=str(path), name="main"), is_validate=True)


@pytest.mark.slow
@pytest.mark.usefixtures("gsm8k_cache")
def test_nexrl_train_on_a_hub_name_with_its_configuration_and_map_fn(tmp_path, tiny_model_path):
    args = [
        "train",
        f"output_dir={tmp_path / 'out'}",
        f"model_path={tiny_model_path}",
        "data.path=openai/gsm8k",
        "data.name=main",
        f"data.map_fn={__name__}:process_example",
        "rollout_worker.group_size=2",
        "rollout_worker.num_workers=2",
        "trajectory_pool.batch_size=4",
        "train_worker.total_train_steps=2",
        "train_worker.log_trained_uids=true",
        "weight.validate_freq=0",
        "validate.validate_before_train=false",
        "validate.data.max_items=4",
        "logger.backend=[jsonl]",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "nexrl.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (saved,) = (tmp_path / "out").rglob("config.yaml")
    text = saved.read_text()
    assert "name: main" in text and f"map_fn: {__name__}:process_example" in text
    lines = [json.loads(x) for x in (saved.parent / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "train/loss" in x] == [1, 2]
