"""Resume picks the newest *complete* checkpoint, says what it skipped, keeps the run folder."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from nexrl.config.loader import load_config
from nexrl.run_setup import (
    WORKER_STATE_FILE,
    find_latest_checkpoint,
    find_resume_checkpoint,
    resolve_run_config,
)
from nexrl.training.checkpoint import atomic_directory


def fake_checkpoint(folder: Path, step: int, worker_state: bool = True) -> Path:
    """A sealed checkpoint as the engine writes it, plus the worker's state file."""
    path = folder / f"global_step_{step}"
    with atomic_directory(path) as staging:
        (staging / "model.safetensors").write_bytes(b"w" * 64)
        (staging / "trainer_state.pt").write_bytes(b"s" * 32)
    if worker_state:
        (path / WORKER_STATE_FILE).write_text(json.dumps({"step": step}))
    return path


def test_latest_skips_incomplete_checkpoints_and_says_why(tmp_path, caplog):
    ckpts = tmp_path / "checkpoints"
    fake_checkpoint(ckpts, 2)
    truncated = fake_checkpoint(ckpts, 4)
    (truncated / "model.safetensors").write_bytes(b"w" * 7)
    no_state = fake_checkpoint(ckpts, 6)
    (no_state / "trainer_state.pt").unlink()
    fake_checkpoint(ckpts, 8, worker_state=False)
    leftover = ckpts / ".global_step_10.staging-123-abcd"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"partial")
    with caplog.at_level(logging.WARNING, logger="nexrl.run_setup"):
        assert find_latest_checkpoint(ckpts) == str(ckpts / "global_step_2")
    log = caplog.text
    assert "global_step_4: model.safetensors has 7 bytes, the manifest says 64" in log
    assert "global_step_6: trainer_state.pt is missing" in log
    assert f"global_step_8: no {WORKER_STATE_FILE}" in log
    assert ".global_step_10.staging-123-abcd: a staging folder" in log


def test_checkpoint_without_marker_is_skipped(tmp_path, caplog):
    old = tmp_path / "global_step_3"
    old.mkdir()
    (old / "model.safetensors").write_bytes(b"w")
    with caplog.at_level(logging.WARNING, logger="nexrl.run_setup"):
        assert find_latest_checkpoint(tmp_path) is None
    assert "no COMPLETE marker" in caplog.text


def _cfg(tmp_path: Path, model: str, mode: str):
    return load_config([f"output_dir={tmp_path}", f"model_path={model}", f"resume.mode={mode}"])


def test_auto_resume_continues_the_run_folder_of_the_newest_complete_checkpoint(
    tmp_path, tiny_model_path
):
    exp = tmp_path / "shift_letters"
    older, newer, broken = exp / "20260101-000000", exp / "20260102-000000", exp / "20260103-0"
    fake_checkpoint(older / "checkpoints", 5)
    fake_checkpoint(newer / "checkpoints", 3)
    os.utime(older / "checkpoints" / "global_step_5", (1, 1))  # mtimes do not decide
    leftover = newer / "checkpoints" / ".global_step_6.staging-1-ff"
    leftover.mkdir()
    fake_checkpoint(broken / "checkpoints", 9, worker_state=False)  # newest, but incomplete

    cfg = resolve_run_config(_cfg(tmp_path, tiny_model_path, "auto"))
    assert Path(cfg.run_dir) == newer.resolve()
    assert cfg.resume.resumed and cfg.resume.resumed_from.endswith("global_step_3")
    assert not leftover.exists()  # the staging folder of the dead save is removed
    assert find_resume_checkpoint(cfg, explicit_checkpoint_path=False).endswith(
        "20260102-000000/checkpoints/global_step_3"
    )
    assert sorted(p.name for p in exp.iterdir()) == [older.name, newer.name, broken.name]


def test_fresh_start_and_disabled_resume_get_a_new_folder(tmp_path, tiny_model_path):
    cfg = resolve_run_config(_cfg(tmp_path, tiny_model_path, "auto"))  # nothing to resume
    assert cfg.resume.resumed is False and cfg.resume.resumed_from is None
    fake_checkpoint(Path(cfg.run_dir) / "checkpoints", 1)
    again = resolve_run_config(_cfg(tmp_path, tiny_model_path, "disable"))
    assert again.run_dir != cfg.run_dir and again.resume.resumed is False
