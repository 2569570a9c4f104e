"""On-policy skip of the old-logprob pass (issue 16).

With one optimizer step per batch, old logprobs equal the current policy's, so the
engine takes them from the update's own forward (detached) and the train worker skips
its no-grad pass. The client below only counts the passes and can turn the skip off,
so the two paths can be compared on the real engine.
"""

from __future__ import annotations

import torch

from nexrl.config.schema import TrainWorkerConfig
from nexrl.training.client import TrainServiceClient
from nexrl.training.synthetic import random_batch
from nexrl.training.train_worker import LossSpec, TrainWorker

ENGINE = {"lr": 1e-2, "grad_clip": 1.0, "seed": 0}
LOSS = {"agg_mode": "token-mean", "clip_low": 0.2, "clip_high": 0.2, "entropy_coef": 0.03}


class CountingClient(TrainServiceClient):
    """The real in-process client, counting the old-logprob passes it is asked for."""

    def __init__(self, model_path: str, fills: bool) -> None:
        super().__init__({"backend": "builtin"}, ENGINE, model_path)
        self._fills = fills
        self.logprob_calls = 0

    @property
    def fills_old_logprobs(self) -> bool:
        return self._fills

    def compute_logprobs(self, batch):
        self.logprob_calls += 1
        return super().compute_logprobs(batch)


def make_worker(tmp_path, model: str, fills: bool, mini_batches: int = 1) -> TrainWorker:
    client = CountingClient(model, fills)
    loss = LossSpec("ppo_clip", dict(LOSS), num_mini_batches=mini_batches, ppo_epochs=1)
    worker = TrainWorker(TrainWorkerConfig(), client, loss, str(tmp_path / "c"), str(tmp_path))
    worker.initialize_workers()
    return worker


def weights(worker: TrainWorker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in worker._client._engine.model.state_dict().items()}


def test_one_step_per_batch_skips_the_pass_and_trains_the_same(tmp_path, tiny_model) -> None:
    extra = make_worker(tmp_path / "a", tiny_model, fills=False)
    skip = make_worker(tmp_path / "b", tiny_model, fills=True)
    metrics = {}
    for name, worker in (("extra", extra), ("skip", skip)):
        batch = random_batch(8, 12, seed=3)
        metrics[name] = worker._update(batch)
    assert extra._client.logprob_calls == 1
    assert skip._client.logprob_calls == 0
    assert abs(metrics["skip"]["ratio_mean"] - 1.0) < 1e-6
    assert abs(metrics["skip"]["loss"] - metrics["extra"]["loss"]) < 1e-6
    a, b = weights(extra), weights(skip)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6


def test_several_steps_per_batch_keep_the_extra_pass(tmp_path, tiny_model) -> None:
    worker = make_worker(tmp_path, tiny_model, fills=True, mini_batches=2)
    batch = random_batch(8, 12, seed=3)
    worker._update(batch)
    assert worker._client.logprob_calls == 1
    assert "old_logprobs" in batch.values
