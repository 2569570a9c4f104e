"""Inference: the built-in engine, nexrl's OpenAI-compatible server and `LLMServiceClient`.

Heavy modules (torch, transformers, fastapi) load only when their names are used.
"""

from nexrl.inference.client import LLMServiceClient, get_local_engine, shutdown_local_engines
from nexrl.inference.protocol import (
    GenerationOutput,
    GenerationRequest,
    GenerationResponse,
    InferenceEngine,
    SamplingParams,
    WeightUpdateMeta,
)

__all__ = [
    "GenerationOutput",
    "GenerationRequest",
    "GenerationResponse",
    "InferenceEngine",
    "LLMServiceClient",
    "SamplingParams",
    "WeightUpdateMeta",
    "get_local_engine",
    "shutdown_local_engines",
]
