"""A real nexrl server (uvicorn in a thread) over the built-in engine."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
import uvicorn

from nexrl.inference.engine import Engine
from nexrl.inference.server import create_app
from nexrl.models.tiny import build_tiny_qwen2

API_KEY = "test-key"


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    return build_tiny_qwen2(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def other_weights_path(tmp_path_factory):
    return build_tiny_qwen2(tmp_path_factory.mktemp("models") / "tiny_seed1", seed=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    def __init__(self, app) -> None:
        self.port = _free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def engine(tiny_path):
    eng = Engine(tiny_path, max_batch_size=32)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def api_key() -> str:
    return API_KEY


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(create_app(engine, api_key=API_KEY)) as srv:
        yield srv
