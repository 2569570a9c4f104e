"""Shared fixtures: one tiny model per session, engines per module."""

from __future__ import annotations

import pytest
import torch

from nexrl.models.tiny import build_tiny_qwen2


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    return build_tiny_qwen2(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def other_weights_path(tmp_path_factory):
    """Same architecture, different random weights (seed 1)."""
    return build_tiny_qwen2(tmp_path_factory.mktemp("models") / "tiny_seed1", seed=1)


@pytest.fixture(scope="session")
def hf_model(tiny_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_path), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def trainer_logprobs():
    """The trainer's logprobs as a function `(model, ids) -> list[float]`."""
    return _trainer_logprobs


def _trainer_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[t] | ids[:t]) for t >= 1, the trainer's way (full forward + log_softmax)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()  # (T, V)
    lp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])
    return lp.squeeze(1).tolist()
