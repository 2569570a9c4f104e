"""wandb (offline), tensorboard and mlflow (local file store), with the real libraries:
each gets the full config, every scalar metric and the sample table, and a second
logger on the same run folder resumes the same tracker run."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nexrl.monitoring import ExperimentLogger
from nexrl.monitoring.loggers import SAMPLE_COLUMNS, sample_rows, with_staleness

CONFIG = {"seed": 3, "algorithm": {"loss_fn": "ppo_clip"}, "weight": {"validate_freq": 25}}
ROWS = [
    {"prompt": "abcd>", "response": "bcde", "reward": 1.0, "version": 4, "staleness": 1},
    {"prompt": "wxyz>", "response": "xyza", "reward": 0.5, "version": 5, "staleness": 0},
]


def _write_config(run_dir: Path) -> None:
    OmegaConf.save(OmegaConf.create(CONFIG), run_dir / "config.yaml")


def _log_a_run(run_dir: Path, backend: str, steps: range) -> ExperimentLogger:
    log = ExperimentLogger(backends=backend, run_dir=run_dir, sample_every=2)
    for step in steps:
        log.post("metrics", data={"reward/mean": step / 10, "hist": {"0": 1}}, step=step)
        log.post("samples", rows=ROWS, step=step)  # kept on even steps only
    log.post("metrics", data={"val/reward": 0.75}, step=steps[-1])
    log.close()
    return log


def test_sample_rows_from_trajectories() -> None:
    trajs = [
        {"prompt": "a", "response": "b", "reward": 1, "token_versions": [3, 2, 3]},
        {"prompt": "c", "response": "d", "reward": 0, "model_version": 5},
        {"prompt": "e", "response": "f", "reward": None},
    ]
    rows = sample_rows(trajs, trained_version=5, limit=3)
    assert [r["version"] for r in rows] == [2, 5, None]
    assert [r["staleness"] for r in rows] == [3, 0, None]
    assert rows[0] == {"prompt": "a", "response": "b", "reward": 1.0, "version": 2, "staleness": 3}
    assert len(sample_rows(trajs, None, limit=1)) == 1
    later = with_staleness(sample_rows(trajs, None, limit=3), trained_version=7)
    assert [r["staleness"] for r in later] == [5, 2, None]


def test_jsonl_samples_follow_sample_every_and_resume_appends(tmp_path) -> None:
    _log_a_run(tmp_path, "jsonl", range(1, 5))
    _log_a_run(tmp_path, "jsonl", range(5, 7))  # same folder: a resumed run appends
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 4, 5, 6, 6]
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [2, 2, 4, 4, 6, 6]
    assert list(samples[0]) == ["step", *SAMPLE_COLUMNS]


def _wandb_records(run_dir: Path) -> list:
    """Records of wandb's offline `.wandb` files (a leveldb-style log of protobufs:
    7-byte file header, 32 KiB blocks, 7-byte chunk headers crc/length/type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    records = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        raw, pos, parts = path.read_bytes(), 7, b""
        while pos + 7 <= len(raw):
            if 32768 - pos % 32768 < 7:
                pos += 32768 - pos % 32768  # block trailer padding
                continue
            _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
            parts += raw[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # FULL or LAST chunk
                record = pb.Record()
                record.ParseFromString(parts)
                records.append(record)
                parts = b""
            if kind == 0:
                break
    return records


def test_wandb_offline_gets_config_metrics_samples_and_resumes(tmp_path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _write_config(tmp_path)
    first = _log_a_run(tmp_path, "wandb", range(1, 3)).backends
    run_id = json.loads((tmp_path / "trackers.json").read_text())["wandb"]
    time.sleep(1.1)  # wandb names an offline run folder by the second: keep the two apart
    _log_a_run(tmp_path, "wandb", range(3, 5))
    assert json.loads((tmp_path / "trackers.json").read_text())["wandb"] == run_id
    assert first == {}  # closed

    records = _wandb_records(tmp_path)
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert {r.run_id for r in runs} == {run_id}  # the second logger resumed the same run
    config = {
        item.key: json.loads(item.value_json)
        for r in records
        if r.WhichOneof("record_type") == "config"
        for item in r.config.update
    }
    config.update({i.key: json.loads(i.value_json) for run in runs for i in run.config.update})
    assert config["algorithm"] == {"loss_fn": "ppo_clip"}
    assert config["weight"] == {"validate_freq": 25}
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = r.history.item
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
            history.setdefault(row["_step"], {}).update(row)
    assert [history[s]["reward/mean"] for s in (1, 2, 3, 4)] == [0.1, 0.2, 0.3, 0.4]
    assert history[4]["val/reward"] == 0.75
    assert history[2]["samples/_type"] == "table-file"
    assert "samples/_type" not in history[3]
    tables = sorted(tmp_path.glob("wandb/offline-run-*/files/media/table/samples_*.table.json"))
    table = json.loads(tables[0].read_text())
    assert table["columns"] == list(SAMPLE_COLUMNS)
    assert table["data"][0] == ["abcd>", "bcde", 1.0, 4, 1]


def test_tensorboard_gets_config_metrics_and_samples(tmp_path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _write_config(tmp_path)
    _log_a_run(tmp_path, "tensorboard", range(1, 5))
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert [e.value for e in events.Scalars("reward/mean")] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert [e.step for e in events.Scalars("val/reward")] == [4]
    texts = {t: events.Tensors(t) for t in events.Tags()["tensors"]}
    config_text = texts["config/text_summary"][0].tensor_proto.string_val[0].decode()
    assert "loss_fn: ppo_clip" in config_text and "validate_freq: 25" in config_text
    samples = texts["samples/text_summary"]
    assert [s.step for s in samples] == [2, 4]
    assert "| abcd> | bcde | 1.0 | 4 | 1 |" in samples[0].tensor_proto.string_val[0].decode()


def test_mlflow_file_store_gets_config_metrics_samples_and_resumes(tmp_path, monkeypatch) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    _write_config(tmp_path)
    first = _log_a_run(tmp_path, "mlflow", range(1, 3))
    run_id = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]
    OmegaConf.save(OmegaConf.create({**CONFIG, "seed": 4, "new_key": 1}), tmp_path / "config.yaml")
    _log_a_run(tmp_path, "mlflow", range(3, 5))  # resumes run_id; a changed param is kept
    assert json.loads((tmp_path / "trackers.json").read_text())["mlflow"] == run_id
    assert first.run_config["seed"] == 3

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run = client.get_run(run_id)
    assert run.data.params["algorithm.loss_fn"] == "ppo_clip"
    assert run.data.params["seed"] == "3" and run.data.params["new_key"] == "1"
    history = client.get_metric_history(run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]
    assert run.data.metrics["val/reward"] == 0.75
    artifacts = {a.path for a in client.list_artifacts(run_id, "samples")}
    assert artifacts == {"samples/step_000002.json", "samples/step_000004.json"}
    table = json.loads(
        Path(client.download_artifacts(run_id, "samples/step_000002.json")).read_text()
    )
    assert table["columns"] == list(SAMPLE_COLUMNS)
    assert table["data"][0] == ["abcd>", "bcde", 1.0, 4, 1]


@pytest.mark.slow
def test_a_training_run_feeds_every_tracker_and_a_second_run_in_its_folder_resumes(
    tmp_path, monkeypatch
) -> None:
    """Two real 1-step runs in one run folder: mlflow gets the resolved config and the
    train metrics, and the second run continues the same mlflow and wandb runs."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from mlflow.tracking import MlflowClient

    from nexrl.config import load_config
    from nexrl.controller import NexRLController

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "run"
    overrides = [
        "train_worker.total_train_steps=1",
        "rollout_worker.group_size=4",
        "trajectory_pool.batch_size=8",
        "validate.validate_before_train=false",
        "validate.data.max_items=4",
        "logger.backend=[jsonl,tensorboard,mlflow,wandb]",
        f"run_dir={run_dir}",
    ]
    ids = []
    for seed in (1, 2):
        controller = NexRLController(load_config([*overrides, f"seed={seed}"]))
        try:
            controller.run()
        finally:
            controller.shutdown()
        ids.append(json.loads((run_dir / "trackers.json").read_text()))
        time.sleep(1.1)  # wandb names offline run folders by the second
    assert ids[0] == ids[1]
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    run = client.get_run(ids[0]["mlflow"])
    assert run.data.params["rollout_worker.group_size"] == "4"
    assert run.data.params["run_dir"] == str(run_dir)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")] == [1, 1]
    assert "val/reward" in run.data.metrics
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps.count(1) >= 4  # both runs appended to one metrics.jsonl
    assert len(list(run_dir.glob("wandb/offline-run-*"))) == 2
