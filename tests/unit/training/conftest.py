"""Shared fixture: one tiny Qwen2 per session (built locally, no download)."""

from __future__ import annotations

import pytest
import torch

from nexrl.models.tiny import build_tiny_qwen2


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    torch.set_num_threads(1)
    return str(build_tiny_qwen2(tmp_path_factory.mktemp("models") / "tiny"))
