"""Builds the in-process inference engine named by `backend` (no Ray, no client).

Kept apart from the client so that Ray replica actors can build their engine
without importing the client that balances over them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nexrl.config.options import ENGINE_DEFAULTS as _D
from nexrl.config.options import ENGINE_OPTIONS, InferenceEngineConfig, engine_config
from nexrl.inference.protocol import InferenceEngine
from nexrl.registry import Registry

if TYPE_CHECKING:
    from nexrl.inference.engine import Engine
    from nexrl.inference.hf_engine import HFEngine

logger = logging.getLogger(__name__)

# Ray mode: the engine lives in named replica actors; run_dir: where a managed server logs
ROUTING_OPTIONS = ("replica_actors", "run_dir")


def check_engine_options(options: Mapping[str, Any]) -> InferenceEngineConfig:
    """The typed options of a `service.inference_service.engine` mapping; a key no engine
    reads, or a value of the wrong type, is a ValueError naming it."""
    return engine_config(options, extra=ROUTING_OPTIONS)


HF_OPTIONS = ("dtype", "device", "max_model_len")  # HFEngine preallocates no KV cache


def build_engine(model_path: str | Path | None = None, **options: Any) -> Engine | HFEngine:
    """The fast `Engine` when the architecture is supported, else `HFEngine` (the
    `builtin` backend; also importable from `nexrl.inference.engine`)."""
    import torch

    from nexrl.inference.engine import Engine
    from nexrl.inference.model_shapes import is_supported
    from nexrl.inference.weights import load_model_and_tokenizer

    if model_path is None:
        from nexrl.models.tiny import default_model_path

        model_path = default_model_path()
    dtype, device = options.pop("dtype", _D.dtype), options.pop("device", _D.device)
    model, tok = load_model_and_tokenizer(model_path, dtype, device)
    if is_supported(model):
        return Engine(model_path, model_and_tokenizer=(model, tok), device=device, **options)
    threads = options.pop("threads", None)
    if threads is not None:  # HFEngine has no thread of its own to give them to
        torch.set_num_threads(int(threads))
    from nexrl.inference.hf_engine import HFEngine

    if options.get("emulated_step_latency_s"):
        raise ValueError(
            f"emulated_step_latency_s needs the built-in engine; {type(model).__name__} "
            "is served by HFEngine"
        )
    logger.info("%s: no lean forward, using HFEngine", type(model).__name__)
    return HFEngine(
        model_path, dtype=dtype, device=device, max_model_len=options.get("max_model_len")
    )


def build_hf_engine(model: str | None, **options: Any) -> InferenceEngine:
    """transformers `generate` behind the engine interface (takes fewer options)."""
    from nexrl.inference.hf_engine import HFEngine

    return HFEngine(model, **{k: v for k, v in options.items() if k in HF_OPTIONS})


ENGINE_BUILDERS: Registry[Callable[..., InferenceEngine]] = Registry(
    "in-process inference backend", "service.inference_service.backend"
)
ENGINE_BUILDERS.add("builtin", build_engine)
ENGINE_BUILDERS.add("hf", build_hf_engine)


def engine_identity(config: Mapping[str, Any]) -> dict[str, object]:
    """What makes two configs the same in-process engine: backend, model and engine options."""
    options = {k: config[k] for k in ENGINE_OPTIONS if config.get(k) is not None}
    return {"backend": config.get("backend") or "builtin", "model": config.get("model"), **options}


def build_local_engine(config: Mapping[str, Any]) -> InferenceEngine:
    """A new engine in this process for `config` (`backend`, `model` and engine options)."""
    backend = config.get("backend") or "builtin"
    options = {k: config[k] for k in ENGINE_OPTIONS if config.get(k) is not None}
    return ENGINE_BUILDERS.get(backend)(config.get("model"), **options)
