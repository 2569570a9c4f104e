"""Tensors on the wire between `TrainServiceClient` and the train service.

Bodies are safetensors bytes (`safetensors.torch.save` / `load`): a format that
holds only tensors and a str -> str header, so nothing received can execute
code. JSON arguments (loss name, loss kwargs) ride in the header under one key.
Only tensor fields of a `Batch` travel; the engine reads nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from safetensors.torch import load, save

from nexrl.types import Batch

ARGS_KEY = "nexrl_args"
CONTENT_TYPE = "application/octet-stream"


def pack(tensors: dict[str, torch.Tensor], args: Mapping[str, object] | None = None) -> bytes:
    """Tensors (made contiguous, CPU, unshared) plus JSON `args` as safetensors bytes."""
    clean = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    return save(clean, metadata={ARGS_KEY: json.dumps(args or {})})


def unpack(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Inverse of `pack`."""
    tensors = load(data)
    header = _header(data)
    return tensors, json.loads(header.get(ARGS_KEY, "{}"))


def pack_batch(batch: Batch, args: Mapping[str, object] | None = None) -> bytes:
    tensors = {k: v for k, v in batch.values.items() if isinstance(v, torch.Tensor)}
    return pack(tensors, args)


def unpack_batch(data: bytes) -> tuple[Batch, dict[str, Any]]:
    tensors, args = unpack(data)
    return Batch(tensors), args


def _header(data: bytes) -> dict[str, str]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n].decode("utf-8")).get("__metadata__", {}) or {}
