"""Fixtures for the fault-injection tests."""

from __future__ import annotations

import pytest

from nexrl.models.tiny import build_tiny_qwen2


@pytest.fixture(scope="session")
def other_weights_path(tmp_path_factory) -> str:
    """Same architecture as the tiny model, other random weights (seed 1)."""
    return str(build_tiny_qwen2(tmp_path_factory.mktemp("models") / "tiny_seed1", seed=1))
