"""The HTTP train service and both TrainServiceClient backends give the same results."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
import uvicorn

from nexrl.training import wire
from nexrl.training.client import TrainServiceClient
from nexrl.training.parallel import free_port
from nexrl.training.service import create_app
from nexrl.training.synthetic import random_batch
from nexrl.training.torch_engine import TorchTrainEngine

ENGINE = {"lr": 1e-3, "ref_model_path": None}
PPO = {"clip_low": 0.2, "clip_high": 0.28}


@contextlib.contextmanager
def serving(engine: TorchTrainEngine, api_key: str | None = None) -> Iterator[str]:
    """A real uvicorn server of `engine` on a free port, in a thread; yields its URL."""
    port = free_port()
    config = uvicorn.Config(
        create_app(engine, api_key=api_key), host="127.0.0.1", port=port, log_level="warning"
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        while not srv.started:
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def server(tiny_model):
    with serving(TorchTrainEngine(ENGINE, tiny_model), api_key="s3cret") as url:
        yield url


@pytest.fixture
def clients(server, tiny_model) -> tuple[TrainServiceClient, TrainServiceClient]:
    """(in-process, remote) clients of the same engine config, both initialized."""
    local = TrainServiceClient({}, ENGINE, tiny_model)
    remote = TrainServiceClient(
        {"backend": "remote", "url": server, "api_key": "s3cret", "max_retries": 0},
        ENGINE,
        "ignored",
    )
    local.initialize()
    remote.initialize()
    return local, remote


def test_remote_equals_in_process(clients, tmp_path):
    local, remote = clients
    batch = random_batch(6, 12, seed=11)
    batch.values["uid"] = [f"u{i}" for i in range(6)]  # non-tensor fields stay behind
    torch.testing.assert_close(
        remote.compute_logprobs(batch), local.compute_logprobs(batch), atol=0, rtol=0
    )
    assert remote.compute_ref_logprobs(batch) is None
    m_remote = remote.train_batch(batch, "ppo_clip", PPO)
    m_local = local.train_batch(batch, "ppo_clip", PPO)
    assert m_remote == m_local
    assert remote.get_step() == local.get_step() == 1
    w_remote, w_local = remote.export_weights(), local.export_weights()
    assert set(w_remote) == set(w_local)
    assert all(torch.equal(w_remote[k], w_local[k]) for k in w_local)
    remote.save_checkpoint(str(tmp_path / "ck"))
    remote.train_batch(batch, "ppo_clip", PPO)
    remote.load_checkpoint(str(tmp_path / "ck"))
    assert remote.get_step() == 1
    assert remote.export_weights(str(tmp_path / "w")) == str(tmp_path / "w")
    assert (tmp_path / "w" / "config.json").exists()
    remote.close()


def test_remote_client_skips_old_logprobs_when_the_service_fills_them(clients):
    """/health says the service's engine fills missing old logprobs from its own forward,
    so the client reports `fills_old_logprobs` (the train worker then skips its no-grad
    pass), and a batch without them trains exactly as in-process."""
    local, remote = clients
    assert remote.fills_old_logprobs and local.fills_old_logprobs
    batch = random_batch(6, 12, seed=5)
    batch.values.pop("old_logprobs")
    assert remote.train_batch(batch, "ppo_clip", PPO) == local.train_batch(batch, "ppo_clip", PPO)


class _NoFill(TorchTrainEngine):
    fills_old_logprobs = False


def test_remote_client_keeps_the_old_pass_for_a_service_that_does_not_fill(tiny_model):
    with serving(_NoFill(ENGINE, tiny_model)) as url:
        remote = TrainServiceClient({"backend": "remote", "url": url}, ENGINE, "ignored")
        remote.initialize()
        assert remote.fills_old_logprobs is False


def test_service_rejects_a_wrong_key_and_reports_engine_errors(server):
    body = wire.pack_batch(random_batch(2, 6))
    assert httpx.post(f"{server}/compute_logprobs", content=body).status_code == 401
    bad = TrainServiceClient({"backend": "remote", "url": server, "api_key": "s3cret"}, {}, "x")
    bad.initialize()
    with pytest.raises(RuntimeError, match="loss_fn"):
        bad._remote().json("POST", "/train_batch", content=body, idempotent=False)


def test_client_config_errors_name_the_key():
    with pytest.raises(ValueError, match="urll"):
        TrainServiceClient({"urll": "x"}, {}, "m")
    with pytest.raises(ValueError, match="backend"):
        TrainServiceClient({"backend": "grpc"}, {}, "m")
    with pytest.raises(ValueError, match="url"):
        TrainServiceClient({"backend": "remote"}, {}, "m")


def test_wire_round_trip_keeps_dtypes_and_args():
    tensors = {"a": torch.arange(6).view(2, 3), "b": torch.rand(2, 3, dtype=torch.bfloat16)}
    out, args = wire.unpack(wire.pack(tensors, {"loss_fn": "ppo_clip", "k": [1, 2]}))
    assert args == {"loss_fn": "ppo_clip", "k": [1, 2]}
    assert all(torch.equal(out[k], tensors[k]) and out[k].dtype == tensors[k].dtype for k in out)
