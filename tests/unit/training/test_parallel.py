"""Data parallel: 2 CPU ranks (gloo) on a global batch == 1 process on the same batch."""

from __future__ import annotations

import pytest
import torch

from nexrl.training.parallel import launch_local, shard_batch
from nexrl.training.synthetic import random_batch
from nexrl.training.torch_engine import TorchTrainEngine

KW = {"clip_low": 0.2, "clip_high": 0.28, "agg_mode": "seq-mean-token-mean"}


def train_two_steps(model_path: str, cfg: dict, rank: int = 0, world: int = 1):
    torch.set_num_threads(1)
    engine = TorchTrainEngine(cfg, model_path)
    metrics = []
    for seed in (20, 21):
        batch = random_batch(7, 12, seed=seed)  # shards of 3 and 4 rows
        batch.values["old_logprobs"] = engine.compute_logprobs(batch)
        metrics.append(engine.train_batch(shard_batch(batch, rank, world), "ppo_clip", KW))
    return engine, metrics


def _rank_main(rank: int, world: int, model_path: str, cfg: dict, out: str) -> None:
    engine, metrics = train_two_steps(model_path, cfg, rank, world)
    state = engine.export_weights()  # a collective under FSDP2: every rank calls it
    engine.save(out + ".ck")  # collective too; rank 0 writes
    if rank == 0:
        torch.save({"metrics": metrics, "state": state}, out)


def test_shard_batch_covers_every_row_once():
    batch = random_batch(5, 4)
    shards = [shard_batch(batch, r, 2) for r in range(2)]
    assert [len(s) for s in shards] == [2, 3]
    torch.testing.assert_close(
        torch.cat([s.values["input_ids"] for s in shards]), batch.values["input_ids"]
    )


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_equal_one_process(tiny_model, tmp_path, strategy):
    # a budget of 1 token: one row per micro-batch, so the ranks run 3 and 4 micro-batches
    cfg = {"micro_batch_tokens": 1, "dp_strategy": strategy, "lr": 1e-3}
    single, single_metrics = train_two_steps(tiny_model, cfg)
    out = str(tmp_path / "rank0.pt")
    launch_local(_rank_main, 2, tiny_model, cfg, out)
    result = torch.load(out, weights_only=True)
    for m_dp, m_one in zip(result["metrics"], single_metrics, strict=True):
        for key in ("loss", "grad_norm", "tokens", "num_seqs", "clip_frac"):
            assert m_dp[key] == pytest.approx(m_one[key], rel=1e-5, abs=1e-7), key
    # Adam divides by sqrt(v): a gradient entry near 0 turns fp32 summation-order noise into
    # a visible fraction of one lr-sized update, so compare at 1% of lr (updates are ~lr).
    initial = TorchTrainEngine({}, tiny_model).export_weights()
    for name, p in single.export_weights().items():
        torch.testing.assert_close(result["state"][name], p, atol=1e-5, rtol=1e-5)
        assert not torch.equal(p, initial[name]), name  # training moved every weight
    # the DP checkpoint resumes in one process with the same weights and Adam state
    resumed = TorchTrainEngine(cfg, tiny_model)
    resumed.load(out + ".ck")
    assert resumed.step == 2
    for name, p in resumed.export_weights().items():
        assert torch.equal(p, result["state"][name]), name
    a, b = resumed.optimizer.state_dict()["state"], single.optimizer.state_dict()["state"]
    for k in a:
        torch.testing.assert_close(a[k]["exp_avg"], b[k]["exp_avg"], atol=1e-6, rtol=1e-4)
