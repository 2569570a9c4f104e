"""Torch threads of the thread that runs a model: one for a small CPU model."""

from __future__ import annotations

import threading

import pytest
import torch

from nexrl.builders import engine_config
from nexrl.config import load_config
from nexrl.models.threads import SMALL_MODEL_PARAMS, threads_for, use_threads
from nexrl.training.synthetic import random_batch
from nexrl.training.torch_engine import TorchTrainEngine


def in_new_thread(fn, threads: int | None):
    """Run `fn` on a fresh thread whose torch count is `threads` (None: as it comes);
    the thread's count after `fn`."""
    seen = []

    def body():
        default = torch.get_num_threads()
        if threads is not None:
            torch.set_num_threads(threads)
        fn()
        seen.append(torch.get_num_threads())
        torch.set_num_threads(default)  # the count later threads take, as it was

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return seen[0]


def test_a_small_cpu_model_gets_one_thread_a_larger_one_keeps_torchs_count():
    small = torch.nn.Linear(100, 100)
    large = torch.nn.Linear(1000, SMALL_MODEL_PARAMS // 1000)  # just above the bound
    assert threads_for(small, None) == 1
    assert threads_for(large, None) is None
    assert threads_for(small, 3) == 3 and threads_for(large, 2) == 2  # set: always wins
    with pytest.raises(ValueError, match="train_worker.engine.threads must be >= 1"):
        threads_for(small, 0, "train_worker.engine.threads")


def test_a_model_on_an_accelerator_gets_one_thread_unless_set():
    """Its thread only launches kernels; whatever its size (the meta device stands in
    for a GPU: any device but the CPU)."""
    large = torch.nn.Linear(1000, SMALL_MODEL_PARAMS // 1000, device="meta")
    assert threads_for(large, None) == 1
    assert threads_for(large, 4) == 4


def test_use_threads_sets_the_calling_threads_count_and_no_other_threads():
    """torch.set_num_threads alone would also hand its count to every thread started
    later; use_threads keeps it to the calling thread."""
    default = in_new_thread(lambda: None, threads=None)
    other = 2 if default == 1 else 1
    assert in_new_thread(lambda: use_threads(other), threads=None) == other
    assert in_new_thread(lambda: None, threads=None) == default  # a later thread: untouched
    assert in_new_thread(lambda: use_threads(None), threads=None) == default


@pytest.mark.parametrize(("option", "expected"), [(None, 1), (2, 2)])
def test_the_trainer_runs_the_tiny_model_on_the_threads_the_rule_picks(
    tiny_model_path, option, expected
):
    """Whichever thread calls the trainer computes on the rule's count: 1 for the tiny
    model unless `train_worker.engine.threads` says otherwise."""
    engine = TorchTrainEngine({"threads": option}, tiny_model_path)
    batch = random_batch(4, 8, seed=0)
    assert (
        in_new_thread(
            lambda: engine.train_batch(batch, "ppo_clip", {"clip_low": 0.2, "clip_high": 0.2}),
            threads=3,
        )
        == expected
    )
    assert in_new_thread(lambda: engine.compute_logprobs(batch), threads=3) == expected


def config(tmp_path, *overrides):
    return load_config([f"output_dir={tmp_path}", *overrides])


def test_a_local_sync_run_gives_the_trainer_every_torch_thread(tmp_path):
    """Sync mode takes turns, so the update gets the process's count; the other modes
    keep the small-model rule (null), and a set value always wins."""
    assert engine_config(config(tmp_path)).threads == torch.get_num_threads()
    assert engine_config(config(tmp_path, "train_worker.engine.threads=3")).threads == 3
    async_cfg = config(tmp_path, "weight.sync_mode=fully-async", "weight.staleness_threshold=1")
    assert engine_config(async_cfg).threads is None
    assert engine_config(config(tmp_path, "launch_mode=ray")).threads is None


def test_a_sync_run_on_a_gpu_leaves_the_trainers_threads_to_the_rule(tmp_path, monkeypatch):
    """The trainer takes the GPU whenever there is one; there it gets one thread
    (`threads_for`), not every core of the host."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert engine_config(config(tmp_path)).threads is None
    assert engine_config(config(tmp_path, "train_worker.engine.threads=3")).threads == 3
