"""LoRA adapters (peft) for the train engine, and their merged export.

With `train_worker.engine.lora` set, the train engine wraps its model with
`peft.get_peft_model`: the base weights are frozen and only the low-rank
adapters (and their AdamW state) are trained, which is what lets a 135M model
train on a laptop-sized CPU. The inference engine knows nothing about
adapters, so every weight push sends MERGED weights, `W + (alpha / r) B A`,
under the base model's own names (`merged_state_dict`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from nexrl.training.torch_engine import TorchTrainEngine

PEFT_PREFIX = "base_model.model."


def apply_lora(model: torch.nn.Module, options: dict[str, Any]) -> torch.nn.Module:
    """`model` wrapped with trainable LoRA adapters (`options`: rank, alpha, ...)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ImportError(
            "train_worker.engine.lora needs the `peft` package: pip install 'nexrl[models]'"
        ) from exc
    config = LoraConfig(
        r=int(options["rank"]),
        # peft annotates an int; it only divides by r, so a float alpha scales as meant
        lora_alpha=float(options["alpha"]),  # type: ignore[arg-type, unused-ignore]
        target_modules=options["target_modules"],
        lora_dropout=float(options["dropout"]),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Base-model state dict with every active adapter merged in (CPU copies).

    The peft model is left untouched (no `merge_and_unload`), so training goes on.
    """
    from peft.tuners.lora import LoraLayer

    merged: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            base_weight = module.get_base_layer().weight
            if not isinstance(base_weight, torch.Tensor):
                raise TypeError(f"LoRA layer {name}: its base layer has no weight tensor")
            weight = base_weight.detach().clone()
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    # every concrete LoraLayer (Linear, Embedding, Conv) defines it; the mixin
                    # peft types `module` as does not declare it
                    delta = module.get_delta_weight(adapter)  # type: ignore[attr-defined, unused-ignore]
                    weight += delta.to(weight.dtype)
            merged[_base_name(name) + ".weight"] = weight
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if "lora_" in key:
            continue
        name = _base_name(key.replace(".base_layer", ""))
        out[name] = merged.get(name, value).detach().to("cpu", copy=True)
    return out


def _base_name(name: str) -> str:
    return name[len(PEFT_PREFIX) :] if name.startswith(PEFT_PREFIX) else name


def load_lora_checkpoint(engine: TorchTrainEngine, path: str) -> None:
    """Resume a LoRA engine from `checkpoint.save`: adapter weights and trainer state."""
    from pathlib import Path

    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    from nexrl.training import checkpoint

    root = Path(path)
    adapter = root / "adapter_model.safetensors"
    if not adapter.exists():
        raise FileNotFoundError(
            f"checkpoint {path} has no adapter_model.safetensors: it was not saved by a "
            "LoRA engine (train_worker.engine.lora)"
        )
    result = set_peft_model_state_dict(engine.model, load_file(str(adapter)))
    unexpected = getattr(result, "unexpected_keys", None)  # peft's stubs: an untyped namedtuple
    if unexpected:
        raise KeyError(f"checkpoint {path}: unknown adapter weights {unexpected[:5]}")
    state_file = root / checkpoint.STATE_FILE
    if not state_file.exists():
        return
    trainer_state = torch.load(state_file, weights_only=True, map_location="cpu")
    set_optimizer_state_dict(
        engine.model,
        engine.optimizer,
        trainer_state["optimizer"],
        options=StateDictOptions(full_state_dict=True),
    )
    engine.scheduler.load_state_dict(trainer_state["scheduler"])
    engine._step = int(trainer_state["step"])
    checkpoint._set_rng_state(trainer_state["rng"])
