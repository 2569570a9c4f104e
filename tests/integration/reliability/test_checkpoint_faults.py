"""Corrupt checkpoints and run files, a full disk, an unwritable folder, and resume's
config (docs/reliability.md, "Checkpoint and run-file faults"). Each fault is made for
real: bytes overwritten in place, a write to /dev/full (the kernel's ENOSPC), a folder
the kernel refuses (/sys)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from nexrl.config import load_config
from nexrl.monitoring.loggers import keep_steps_up_to
from nexrl.run_setup import (
    WORKER_STATE_FILE,
    find_latest_checkpoint,
    older_checkpoint,
    resolve_run_config,
)
from nexrl.training.checkpoint import (
    COMPLETE_FILE,
    CheckpointWriteError,
    atomic_directory,
    verify_checkpoint,
)


def _save(folder: Path, step: int) -> Path:
    path = folder / f"global_step_{step}"
    with atomic_directory(path) as staging:
        torch.save({"step": step, "w": torch.arange(64.0)}, staging / "trainer_state.pt")
        (staging / "model.safetensors").write_bytes(b"\x08" + bytes(200))
        (staging / WORKER_STATE_FILE).write_text(json.dumps({"step": step}))
    return path


def _garble(path: Path) -> None:
    """Same size, other bytes: what a size check cannot see."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["trainer_state.pt", "model.safetensors", WORKER_STATE_FILE])
def test_same_size_garbage_is_caught_and_resume_falls_back(tmp_path, caplog, name):
    ckpts = tmp_path / "checkpoints"
    _save(ckpts, 2)
    newest = _save(ckpts, 4)
    _garble(newest / name)
    assert f"{name} does not match its sha256" in verify_checkpoint(newest)
    with caplog.at_level(logging.WARNING):
        assert find_latest_checkpoint(ckpts) == str(ckpts / "global_step_2")
    assert f"skipping checkpoint {newest}: {name} does not match its sha256" in caplog.text


@pytest.mark.parametrize(
    ("files", "problem"),
    [
        ({"trainer_state.pt": {}}, "'trainer_state.pt' has no integer 'size'"),
        (["trainer_state.pt"], "'files' must map names (list)"),
        ({"trainer_state.pt": {"size": "12"}}, "has no integer 'size'"),
        (None, "'files' must map names (no 'files' key)"),
    ],
)
def test_malformed_manifest_is_a_one_line_problem(tmp_path, files, problem):
    path = _save(tmp_path / "checkpoints", 2)
    manifest = {"format": 1} if files is None else {"format": 1, "files": files}
    (path / COMPLETE_FILE).write_text(json.dumps(manifest))
    found = verify_checkpoint(path)
    assert problem in found and "\n" not in found
    assert find_latest_checkpoint(tmp_path / "checkpoints") is None


def test_older_checkpoint_is_the_fallback(tmp_path):
    ckpts = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        _save(ckpts, step)
    _garble(ckpts / "global_step_4" / "trainer_state.pt")
    newest = str(ckpts / "global_step_6")
    assert older_checkpoint(newest, {newest}) == str(ckpts / "global_step_2")
    assert older_checkpoint(str(ckpts / "global_step_2"), set()) is None


def _auto(tmp_path: Path, *extra: str):
    return load_config([f"output_dir={tmp_path / 'out'}", "resume.mode=auto", *extra])


def test_all_checkpoints_bad_is_a_clear_failure_not_step_0(tmp_path):
    run = tmp_path / "out" / "shift_letters" / "20260101-000000"
    for step in (2, 4):
        _garble(_save(run / "checkpoints", step) / "trainer_state.pt")
    with pytest.raises(ValueError) as err:
        resolve_run_config(_auto(tmp_path))
    message = str(err.value)
    assert "none of the 2 checkpoints found is usable" in message
    assert "global_step_4: trainer_state.pt does not match its sha256" in message
    assert "resume.mode=disable" in message and "\n" not in message
    fresh = resolve_run_config(_auto(tmp_path, "resume.mode=disable"))  # asked for: fresh
    assert Path(fresh.run_dir) != run and not fresh.resume.resumed


def test_torn_jsonl_lines_are_dropped_naming_the_file(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "loss": 0.5}) for s in (1, 2, 3)]
    path.write_bytes(("\n".join(rows) + '\n{"step": 4, "lo').encode() + b"\xe2\x82")
    with caplog.at_level(logging.WARNING):
        keep_steps_up_to(path, 2)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
    assert f"{path}:4: dropping a torn line" in caplog.text


def test_disk_full_is_one_line_and_keeps_saved_checkpoints(tmp_path):
    """/dev/full answers every write with ENOSPC; torch.save's zip writer turns that into
    `enforce fail ... unexpected pos`, which must read as a full disk too."""
    ckpts = tmp_path / "checkpoints"
    saved = _save(ckpts, 2)
    for write in (
        lambda staging: torch.save({"w": torch.zeros(10_000)}, staging / "trainer_state.pt"),
        lambda staging: (staging / "trainer_state.pt").write_bytes(bytes(10_000)),
    ):
        with (
            pytest.raises(CheckpointWriteError) as err,
            atomic_directory(ckpts / "global_step_4") as staging,
        ):
            os.symlink("/dev/full", staging / "trainer_state.pt")
            write(staging)
        assert f"cannot write {ckpts / 'global_step_4'}: disk full" in str(err.value)
        assert "\n" not in str(err.value)
    assert verify_checkpoint(saved) is None
    assert sorted(p.name for p in ckpts.iterdir()) == ["global_step_2"]  # no staging left


def test_unwritable_output_dir_is_one_line(tmp_path):
    cfg = load_config(["output_dir=/sys/nexrl-cannot-write-here"])
    with pytest.raises(OSError) as err:
        resolve_run_config(cfg)
    assert str(err.value).startswith("[Errno 1] cannot write /sys/nexrl-cannot-write-here")


def _started_run(tmp_path: Path, *overrides: str) -> Path:
    """A run folder as a first `nexrl train` leaves it: config.yaml and one checkpoint."""
    cfg = resolve_run_config(load_config([f"output_dir={tmp_path / 'out'}", *overrides]))
    _save(Path(cfg.train_worker.checkpoint_path), 2)
    return Path(cfg.run_dir)


def test_resume_auto_keeps_the_runs_own_config(tmp_path, caplog):
    run = _started_run(tmp_path, "data.max_items=12", "rollout_worker.max_tokens=3")
    before = (run / "config.yaml").read_text()
    with caplog.at_level(logging.WARNING):
        cfg = resolve_run_config(_auto(tmp_path))  # the quickstart's command, no overrides
    assert Path(cfg.run_dir) == run and cfg.resume.resumed
    assert cfg.data.max_items == 12 and cfg.rollout_worker.max_tokens == 3
    warning = [r.getMessage() for r in caplog.records if "config.yaml" in r.getMessage()]
    assert len(warning) == 1
    assert "the run's value kept for data.max_items, rollout_worker.max_tokens (" in warning[0]
    assert (run / "config.yaml").read_text() == before
    assert not list(run.glob("config.resumed-*.yaml"))


def test_resume_auto_takes_what_the_command_asks_for(tmp_path, caplog):
    """A key set away from its default on the resume command (a longer run) is asked for;
    the run's other keys stay."""
    run = _started_run(tmp_path, "data.max_items=12")
    with caplog.at_level(logging.WARNING):
        cfg = resolve_run_config(_auto(tmp_path, "train_worker.total_train_steps=7"))
    assert cfg.train_worker.total_train_steps == 7 and cfg.data.max_items == 12
    assert Path(cfg.run_dir) == run
    assert "this command's value kept for train_worker.total_train_steps;" in caplog.text
    assert "the run's value kept for data.max_items (" in caplog.text


def test_resume_with_this_commands_config_writes_beside(tmp_path):
    run = _started_run(tmp_path, "data.max_items=12")
    before = (run / "config.yaml").read_text()
    cfg = resolve_run_config(_auto(tmp_path, "resume.use_saved_config=false"))
    assert Path(cfg.run_dir) == run and cfg.data.max_items is None
    assert (run / "config.yaml").read_text() == before  # the owner's record stays
    (beside,) = run.glob("config.resumed-*.yaml")
    assert OmegaConf.load(beside).data.max_items is None
