"""The model around the train engine: wrappers, the head, the device and seeding."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator, Sequence

import torch
from transformers import PreTrainedModel

from nexrl.training.config import EngineConfig


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a DDP / peft wrapper."""
    inner = getattr(module, "module", module)  # DDP
    get_base = getattr(inner, "get_base_model", None)  # peft
    return get_base() if get_base is not None else inner


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


JOINED_PROJECTIONS = (
    ("self_attn", ("q_proj", "k_proj", "v_proj")),
    ("mlp", ("gate_proj", "up_proj")),
)
"""The linears of a decoder layer that an inference engine multiplies as one matrix."""


@torch.no_grad()
def join_projections(model: torch.nn.Module) -> int:
    """Lay out each decoder layer's q/k/v projections, and its gate/up projections, as
    consecutive row blocks of one tensor (weights and biases apart): the parameters become
    views of it, with the same values, and train as before. The built-in engine, when it
    takes these tensors as its weights (a sync run in one process, `SharedState`),
    multiplies by the joined matrix in place instead of keeping a concatenated copy
    (SmolLM2: 0.26 GiB; nexrl/inference/model_runner.py). Returns the groups joined."""
    layers = getattr(getattr(unwrap(model), "model", None), "layers", None)
    joined = 0
    for block in layers if isinstance(layers, torch.nn.ModuleList) else ():
        for parent, names in JOINED_PROJECTIONS:
            found = [getattr(getattr(block, parent, None), name, None) for name in names]
            linears = [m for m in found if isinstance(m, torch.nn.Linear)]
            if len(linears) == len(names):
                joined += _join_rows([linear.weight for linear in linears])
                biases = [linear.bias for linear in linears if linear.bias is not None]
                if len(biases) == len(names):
                    _join_rows(biases)
    return joined


def _join_rows(params: Sequence[torch.Tensor]) -> int:
    if len({(p.dtype, p.device, p.shape[1:]) for p in params}) > 1:
        return 0
    block = torch.cat([p.detach() for p in params])
    offset = 0
    for p in params:
        p.data = block[offset : offset + p.shape[0]]
        offset += p.shape[0]
    return 1
