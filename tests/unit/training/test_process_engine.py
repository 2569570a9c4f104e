"""`service.train_service.backend=process`: the train engine in a child process gives
exactly the in-process engine's results, its weights cross through shared memory,
and its failures reach the caller by name."""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from nexrl.training.client import TrainServiceClient
from nexrl.training.synthetic import random_batch
from nexrl.training.torch_engine import TorchTrainEngine

ENGINE = {"lr": 1e-3, "ref_model_path": None}
PPO = {"clip_low": 0.2, "clip_high": 0.28}


def _buffer_files() -> set[str]:
    return set(glob.glob("/dev/shm/nexrl-train-weights-*")) | set(
        glob.glob(os.path.join(os.environ.get("TMPDIR", "/tmp"), "nexrl-train-weights-*"))
    )


@pytest.fixture(scope="module")
def pair(tiny_model):
    """(in-process, child-process) clients of the same engine config, both initialized."""
    local = TrainServiceClient({}, ENGINE, tiny_model)
    child = TrainServiceClient({"backend": "process"}, ENGINE, tiny_model)
    local.initialize()
    child.initialize()
    yield local, child
    child.close()


def test_child_process_trains_exactly_like_in_process(pair, tmp_path):
    local, child = pair
    assert child.fills_old_logprobs == local.fills_old_logprobs is True
    assert child._engine.pid != os.getpid()
    before = _buffer_files()
    for seed in (1, 2):
        batch = random_batch(6, 12, seed=seed)
        batch.values["uid"] = [f"u{i}" for i in range(6)]  # non-tensor fields stay behind
        torch.testing.assert_close(
            child.compute_logprobs(batch), local.compute_logprobs(batch), atol=0, rtol=0
        )
        assert child.compute_ref_logprobs(batch) is None
        assert child.train_batch(batch, "ppo_clip", PPO) == local.train_batch(
            batch, "ppo_clip", PPO
        )
        w_child, w_local = child.export_weights(), local.export_weights()
        assert list(w_child) == list(w_local)
        assert all(torch.equal(w_child[k], w_local[k]) for k in w_local)
    assert child.get_step() == local.get_step() == 2
    assert _buffer_files() == before  # the shared buffer is unlinked once both mapped it
    # an export is a copy: the next step does not change what the caller holds
    held = child.export_weights()
    frozen = {k: v.clone() for k, v in held.items()}
    child.train_batch(random_batch(6, 12, seed=3), "ppo_clip", PPO)
    assert all(torch.equal(held[k], frozen[k]) for k in held)
    assert not all(torch.equal(held[k], v) for k, v in child.export_weights().items())
    local.train_batch(random_batch(6, 12, seed=3), "ppo_clip", PPO)  # keep the pair equal


def test_checkpoints_and_hf_exports_cross_between_backends(pair, tmp_path, tiny_model):
    local, child = pair
    child.save_checkpoint(str(tmp_path / "ck"))
    resumed = TorchTrainEngine(ENGINE, tiny_model)
    resumed.load(str(tmp_path / "ck"))
    assert resumed.step == child.get_step()
    weights = child.export_weights()
    assert all(torch.equal(resumed.export_weights()[k], weights[k]) for k in weights)
    assert child.export_weights(str(tmp_path / "hf")) == str(tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    child.load_checkpoint(str(tmp_path / "ck"))  # and back into the child
    assert child.get_step() == resumed.step


def test_errors_name_the_call_and_the_engine_keeps_serving(pair):
    _, child = pair
    batch = random_batch(4, 8, seed=5)
    with pytest.raises((KeyError, ValueError), match=r"no_such_loss.*raised at .*\.py:\d+"):
        child.train_batch(batch, "no_such_loss", {})
    with pytest.raises(FileNotFoundError, match="train process, load"):
        child.load_checkpoint("/nonexistent/checkpoint")
    assert child.compute_logprobs(batch).shape == batch.values["input_ids"].shape


def test_lora_exports_merged_weights_then_a_dead_process_fails_the_next_call(tiny_model):
    lora = {**ENGINE, "lora": {"rank": 4, "alpha": 8}}
    client = TrainServiceClient({"backend": "process"}, lora, tiny_model)
    client.initialize()
    local = TrainServiceClient({}, lora, tiny_model)
    local.initialize()
    for each in (client, local):
        each.train_batch(random_batch(6, 12, seed=1), "ppo_clip", PPO)
    merged, expected = client.export_weights(), local.export_weights()
    assert list(merged) == list(expected) and not any("lora" in k for k in merged)
    assert all(torch.equal(merged[k], expected[k]) for k in expected)
    os.kill(client._engine.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="train process .* ended during 'train_batch'.*SIGKILL"):
        client.train_batch(random_batch(4, 8, seed=5), "ppo_clip", PPO)
    client.close()


def test_a_bad_model_fails_start_up_naming_it_and_the_child_returns(tmp_path):
    """The child names the bad path in the start-up error, then exits cleanly."""
    broken = TrainServiceClient({"backend": "process"}, ENGINE, str(tmp_path / "missing"))
    with pytest.raises(Exception, match="missing"):
        broken.initialize()


def test_the_shared_buffer_holds_mixed_dtypes_and_odd_sizes_exactly(monkeypatch, tmp_path):
    """The layout aligns every tensor; a new layout (other shapes) makes a new buffer; a
    /dev/shm without room sends the buffer to the temp folder."""
    from nexrl.training import process_engine as pe

    state = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.arange(11, dtype=torch.int64),
        "d": torch.tensor(2.5, dtype=torch.float16),
    }
    served = pe._Served(engine=None)
    first = served.export(state)
    assert first["file"] and all(offset % 64 == 0 for *_, offset in first["layout"])
    views = pe._views(first["file"], first["layout"], first["nbytes"])
    os.unlink(first["file"])
    assert all(torch.equal(views[k], v) and views[k].dtype == v.dtype for k, v in state.items())
    state["a"] += 1  # same layout: written in place, no new file
    assert served.export(state) == {"file": None} and torch.equal(views["a"], state["a"])
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(pe.tempfile, "tempdir", None)
    monkeypatch.setattr(pe.shutil, "disk_usage", lambda _: SimpleNamespace(free=0))
    grown = served.export({**state, "e": torch.zeros(2)})
    assert grown["file"].startswith(str(tmp_path)) and len(grown["layout"]) == 5
    os.unlink(grown["file"])


SCRIPT = """
import sys
from nexrl.training.client import TrainServiceClient

def main():
    client = TrainServiceClient({"backend": "process"}, {"lr": 1e-3}, sys.argv[1])
    client.initialize()
    print("started a child")
"""


def _run_script(path, model) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(path), str(model)], capture_output=True, text=True, timeout=300
    )


def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path, tiny_model):
    """The spawned child imports the script again; the parent's error says what to fix
    (before, it read "exited with status 1"). With the guard the same script runs."""
    script = tmp_path / "run.py"
    script.write_text(SCRIPT + "main()\n")
    proc = _run_script(script, tiny_model)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "train process" in last and "during 'start'" in last
    assert 'without an `if __name__ == "__main__":` guard' in last
    script.write_text(SCRIPT + 'if __name__ == "__main__":\n    main()\n')
    proc = _run_script(script, tiny_model)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "started a child" in proc.stdout


def test_spawning_while_a_child_imports_the_script_stops_that_child(monkeypatch):
    from nexrl.inference.health import describe_exit
    from nexrl.spawn import UNGUARDED_MAIN_EXIT_CODE, spawn_context

    assert spawn_context().get_start_method() == "spawn"
    monkeypatch.setattr(mp.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(SystemExit) as stopped:
        spawn_context()
    assert stopped.value.code == UNGUARDED_MAIN_EXIT_CODE
    assert "__main__" in describe_exit(UNGUARDED_MAIN_EXIT_CODE)
