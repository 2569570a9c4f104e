"""Atomic checkpoints: staging + manifest + rename; incomplete folders are named and refused."""

from __future__ import annotations

import json

import pytest

from nexrl.training import checkpoint
from nexrl.training.torch_engine import TorchTrainEngine


@pytest.fixture(scope="module")
def saved(tiny_model, tmp_path_factory):
    """One real checkpoint of the tiny model; tests copy it before damaging it."""
    engine = TorchTrainEngine({"lr": 1e-2}, tiny_model)
    path = tmp_path_factory.mktemp("ck") / "global_step_1"
    engine.save(str(path))
    return path


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_save_writes_a_manifest_of_every_file_and_no_staging_folder(saved):
    manifest = json.loads((saved / checkpoint.COMPLETE_FILE).read_text())
    on_disk = {p.name for p in saved.iterdir()} - {checkpoint.COMPLETE_FILE}
    assert set(manifest["files"]) == on_disk
    assert {"model.safetensors", checkpoint.STATE_FILE} <= on_disk
    assert all(manifest["files"][n]["size"] == (saved / n).stat().st_size for n in on_disk)
    assert checkpoint.verify_checkpoint(saved) is None
    assert checkpoint.staging_leftovers(saved.parent) == []


def test_truncated_weights_are_named(saved, tmp_path):
    ck = _copy(saved, tmp_path / "global_step_1")
    weights = ck / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert "model.safetensors has 100 bytes" in checkpoint.verify_checkpoint(ck)


def test_missing_trainer_state_is_named(saved, tmp_path):
    ck = _copy(saved, tmp_path / "global_step_1")
    (ck / checkpoint.STATE_FILE).unlink()
    assert checkpoint.verify_checkpoint(ck) == f"{checkpoint.STATE_FILE} is missing"


def test_no_marker_and_bad_hash_are_named(saved, tmp_path):
    ck = _copy(saved, tmp_path / "global_step_1")
    checkpoint.seal(ck, hash_files=True)
    assert checkpoint.verify_checkpoint(ck) is None
    cfg = ck / "config.json"
    cfg.write_text(cfg.read_text().replace('"', "'"))  # same size, other bytes
    assert "config.json does not match its sha256" in checkpoint.verify_checkpoint(ck)
    (ck / checkpoint.COMPLETE_FILE).unlink()
    assert "no COMPLETE marker" in checkpoint.verify_checkpoint(ck)


def test_load_refuses_an_incomplete_checkpoint_with_the_reason(saved, tiny_model, tmp_path):
    ck = _copy(saved, tmp_path / "global_step_1")
    (ck / "model.safetensors").write_bytes(b"\0" * 10)
    engine = TorchTrainEngine({"lr": 1e-2}, tiny_model)
    with pytest.raises(ValueError, match="incomplete: model.safetensors has 10 bytes"):
        engine.load(str(ck))


def test_atomic_directory_publishes_all_or_nothing(tmp_path):
    final = tmp_path / "global_step_2"
    with pytest.raises(RuntimeError), checkpoint.atomic_directory(final) as staging:
        (staging / "a.bin").write_bytes(b"x" * 10)
        raise RuntimeError("killed mid-save")
    assert not final.exists() and list(tmp_path.iterdir()) == []

    with checkpoint.atomic_directory(final) as staging:
        (staging / "a.bin").write_bytes(b"x" * 10)
        assert not final.exists()  # nothing visible before the block ends
    assert checkpoint.verify_checkpoint(final) is None

    with checkpoint.atomic_directory(final) as staging:  # a re-save replaces it whole
        (staging / "b.bin").write_bytes(b"y")
    assert sorted(p.name for p in final.iterdir()) == ["COMPLETE", "b.bin"]
    assert [p.name for p in tmp_path.iterdir()] == ["global_step_2"]


def test_weight_export_is_replaced_whole(tiny_model, tmp_path):
    engine = TorchTrainEngine({"lr": 1e-2}, tiny_model)
    export = tmp_path / "sync_weights"
    engine.export_weights(str(export))
    before = (export / "model.safetensors").read_bytes()
    (export / "stale.bin").write_bytes(b"from an older export")
    run_one_step(engine)
    engine.export_weights(str(export))
    assert checkpoint.verify_checkpoint(export) is None
    assert not (export / "stale.bin").exists()  # a new folder, not files written over the old
    assert (export / "model.safetensors").read_bytes() != before
    assert [p.name for p in tmp_path.iterdir()] == ["sync_weights"]


def run_one_step(engine: TorchTrainEngine) -> None:
    from nexrl.training.synthetic import random_batch

    batch = random_batch(6, 12, seed=0)
    batch.values["old_logprobs"] = engine.compute_logprobs(batch)
    engine.train_batch(batch, "ppo_clip", {"clip_low": 0.2, "clip_high": 0.2})
