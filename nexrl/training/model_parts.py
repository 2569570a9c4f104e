"""The model around the train engine: wrappers, the head, the device and seeding."""

from __future__ import annotations

import contextlib
import itertools
import os
import random
from collections.abc import Iterator

import torch
from transformers import PreTrainedModel

from nexrl.training.config import EngineConfig


def unwrap(module: torch.nn.Module) -> PreTrainedModel:
    """The Hugging Face model inside a DDP / peft wrapper."""
    inner = getattr(module, "module", module)  # DDP
    get_base = getattr(inner, "get_base_model", None)  # peft
    model = get_base() if get_base is not None else inner
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"the train engine needs an HF PreTrainedModel, got {type(model).__name__}")
    return model


def can_chunk(model: PreTrainedModel, config: EngineConfig) -> bool:
    """Chunking needs a plain linear head and whole (unsharded) head weights."""
    head = model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    sharded = config.dp_strategy == "fsdp2" and world_size() > 1
    return isinstance(head, torch.nn.Linear) and head.bias is None and not softcap and not sharded


def checkpointing_on(model: torch.nn.Module) -> bool:
    """Whether activation checkpointing is on (transformers 5 renamed the flag)."""
    name = "is_activation_checkpointing"
    name = name if hasattr(type(model), name) else "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@contextlib.contextmanager
def without_head(model: PreTrainedModel) -> Iterator[torch.Tensor]:
    """Run `model` with an identity output layer (its "logits" are the final hidden states);
    yields the head's weight for `chunked_token_logprobs`."""
    head = model.get_output_embeddings()
    assert head is not None, "without_head needs a model with an output layer"
    model.set_output_embeddings(torch.nn.Identity())
    try:
        yield head.weight
    finally:
        model.set_output_embeddings(head)


def pick_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


@torch.no_grad()
def own_memory(model: torch.nn.Module) -> None:
    """Give every parameter and buffer of `model` memory of its own. `from_pretrained`
    maps the checkpoint file: the optimizer's first step copies each page it writes,
    but a tensor replaced before (`join_projections`) would keep its pages resident as
    long as any other tensor keeps the mapping (SmolLM2: 0.26 GiB)."""
    for t in itertools.chain(model.parameters(), model.buffers()):
        t.data = t.data.clone()
