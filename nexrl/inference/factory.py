"""Builds the in-process inference engine named by `backend` (no Ray, no client).

Kept apart from the client so that Ray replica actors can build their engine
without importing the client that balances over them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nexrl.config.options import ENGINE_OPTIONS, InferenceEngineConfig, engine_config
from nexrl.inference.protocol import InferenceEngine
from nexrl.registry import Registry

# Ray mode: the engine lives in named replica actors; run_dir: where a managed server logs
ROUTING_OPTIONS = ("replica_actors", "run_dir")


def check_engine_options(options: Mapping[str, Any]) -> InferenceEngineConfig:
    """The typed options of a `service.inference_service.engine` mapping; a key no engine
    reads, or a value of the wrong type, is a ValueError naming it."""
    return engine_config(options, extra=ROUTING_OPTIONS)


HF_OPTIONS = ("dtype", "device", "max_model_len")  # HFEngine preallocates no KV cache


def build_hf_engine(model: str | None, **options: Any) -> InferenceEngine:
    """transformers `generate` behind the engine interface (takes fewer options)."""
    from nexrl.inference.hf_engine import HFEngine

    return HFEngine(model, **{k: v for k, v in options.items() if k in HF_OPTIONS})


ENGINE_BUILDERS = Registry("in-process inference backend", "service.inference_service.backend")
ENGINE_BUILDERS.add("builtin", "nexrl.inference.engine:build_engine")
ENGINE_BUILDERS.add("hf", build_hf_engine)


def build_local_engine(config: Mapping[str, Any]) -> InferenceEngine:
    """A new engine in this process for `config` (`backend`, `model` and engine options)."""
    backend = config.get("backend") or "builtin"
    options = {k: config[k] for k in ENGINE_OPTIONS if config.get(k) is not None}
    return ENGINE_BUILDERS.get(backend)(config.get("model"), **options)
