"""Checkpoints of the torch engine: HF weights plus an exact trainer state.

Layout of a checkpoint directory:

    config.json, model*.safetensors   `save_pretrained`: loadable by `from_pretrained`
    tokenizer files                   copied from the engine's model path, if it has them
    trainer_state.pt                  optimizer, scheduler, RNG states, step

`trainer_state.pt` holds only tensors, numbers, strings and containers, and is
read with `torch.load(weights_only=True)`, so a checkpoint cannot run code.
Full (unsharded) state dicts go through `torch.distributed.checkpoint.state_dict`,
which works the same for a plain module, DDP and FSDP2; rank 0 writes.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

if TYPE_CHECKING:
    from nexrl.training.torch_engine import TorchTrainEngine

STATE_FILE = "trainer_state.pt"
TOKENIZER_FILES = (
    "tokenizer_config.json",
    "tokenizer.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)


def _options(cpu_offload: bool = True) -> StateDictOptions:
    distributed = dist.is_available() and dist.is_initialized()
    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload and distributed)


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded state dict as independent CPU tensors (no shared storage)."""
    state = get_model_state_dict(model, options=_options())
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def write_hf(engine: TorchTrainEngine, path: str, state: dict[str, torch.Tensor]) -> None:
    """Write `state` as an HF model directory plus the tokenizer (rank 0 only)."""
    if engine.rank != 0:
        return
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    engine.model.save_pretrained(str(out), state_dict=state, safe_serialization=True)
    for name in TOKENIZER_FILES:
        src = Path(engine.model_path) / name
        if src.exists():
            (out / name).write_bytes(src.read_bytes())


def save(engine: TorchTrainEngine, path: str) -> None:
    """Weights (HF format) and trainer state; every rank must call it (collectives)."""
    state = full_model_state(engine.model)
    optim = get_optimizer_state_dict(engine.model, engine.optimizer, options=_options())
    write_hf(engine, path, state)
    if engine.rank == 0:
        trainer_state = {
            "step": engine.step,
            "optimizer": optim,
            "scheduler": engine.scheduler.state_dict(),
            "rng": _rng_state(),
        }
        torch.save(trainer_state, Path(path) / STATE_FILE)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def load(engine: TorchTrainEngine, path: str) -> None:
    """Restore what `save` wrote; a directory without trainer_state.pt loads weights only."""
    root = Path(path)
    state = read_hf_weights(root)
    tied = set(getattr(engine.model, "_tied_weights_keys", None) or [])
    expected = set(get_model_state_dict(engine.model, options=_options(False)))
    missing = sorted(expected - set(state) - tied)
    if missing:
        raise KeyError(f"checkpoint {path} lacks weights {missing[:5]} (of {len(missing)})")
    set_model_state_dict(
        engine.model, state, options=StateDictOptions(full_state_dict=True, strict=False)
    )
    state_file = root / STATE_FILE
    if not state_file.exists():
        return
    trainer_state: dict[str, Any] = torch.load(state_file, weights_only=True, map_location="cpu")
    set_optimizer_state_dict(
        engine.model,
        engine.optimizer,
        trainer_state["optimizer"],
        options=StateDictOptions(full_state_dict=True),
    )
    engine.scheduler.load_state_dict(trainer_state["scheduler"])
    engine._step = int(trainer_state["step"])
    _set_rng_state(trainer_state["rng"])


def read_hf_weights(root: Path) -> dict[str, torch.Tensor]:
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights under {root}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
