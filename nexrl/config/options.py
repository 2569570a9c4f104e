"""Typed options of components whose config section is shared or free-form.

`InferenceEngineConfig` holds the built-in engine's options: the only place their
defaults are written. `Engine`, `build_engine`, `HFEngine` and `nexrl serve` read
their defaults from it, and `service.inference_service.engine` (a mapping, because
backends take different option sets: vLLM has its own, docs/inference.md) is checked
against it. `RayGroupConfig` and `RayRanksConfig` type the entries of the `ray.*`
maps. A test compares every constructor default fed by these with the field here.
Kept out of `schema.py` so that the engine imports its options without the schema.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ENGINE_KEY = "service.inference_service.engine"


@dataclass
class InferenceEngineConfig:
    max_batch_size: int = 128
    """Running samples at most (KV cache rows). The packaged `rl_train.yaml` sets 256, so
    that a default step's 16 x 16 samples decode as one batch."""
    max_model_len: int | None = None
    """Prompt plus output positions; null: the longest that fits `kv_cache_gib` at
    `max_batch_size` rows, capped by the model's context (docs/models.md)."""
    kv_cache_gib: float | None = None
    """KV cache budget in GiB; null: 2.0."""
    max_prefill_tokens: int = 8192
    """Padded prompt tokens per prefill forward."""
    dtype: str = "float32"
    """Weights and compute dtype: `float32`, `bfloat16` or `float16`."""
    device: str = "cpu"
    """`cpu` or `cuda` (an `Engine` given a ready-made model runs on that model's device)."""
    seed: int = 0
    """Sampling seed of requests that carry none."""
    emulated_step_latency_s: float = 0.0
    """A sleep added to every scheduler step, so that generation behaves like an
    accelerator beside the trainer (docs/async.md); 0: off."""
    matmul: str = "auto"
    """Decode matmul kernel (docs/inference.md)."""
    native_attention: bool = True
    """Use the C attention kernel where it is built (docs/inference.md)."""
    gather_quiet_s: float = 0.002
    """Idle engine: wait while each new request comes within this many seconds of the last,
    so a burst shares one prefill (docs/inference.md, the gather window)."""
    gather_max_s: float = 0.02
    """Longest gather wait."""
    threads: int | None = None
    """Torch threads of the engine's own thread; null: 1 on a GPU or for a model under 1M
    parameters on a CPU, else the process's torch thread count (docs/training.md)."""
    prefix_cache_gib: float = 0.25
    """Memory for prompt KV reused across requests; 0: off."""
    cuda_graphs: bool = True
    """The decode step as CUDA graphs (read on a GPU only)."""


ENGINE_OPTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(InferenceEngineConfig))
ENGINE_DEFAULTS = InferenceEngineConfig()
"""The defaults, for signatures: `max_batch_size: int = ENGINE_DEFAULTS.max_batch_size`."""


def engine_config(options: Mapping[str, Any], extra: tuple[str, ...] = ()) -> InferenceEngineConfig:
    """The typed engine options of a `service.inference_service.engine` mapping: a key that
    is no option (nor in `extra`) or a value of the wrong type is a ValueError naming it."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    unknown = sorted(set(options) - set(ENGINE_OPTIONS) - set(extra))
    if unknown:
        keys = ", ".join(f"{ENGINE_KEY}.{k}" for k in unknown)
        raise ValueError(f"{keys}: unknown engine option; valid: {', '.join(ENGINE_OPTIONS)}")
    ours = {k: v for k, v in options.items() if k in ENGINE_OPTIONS}
    try:
        merged = OmegaConf.merge(OmegaConf.structured(InferenceEngineConfig), ours)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", "") or "?"
        raise ValueError(
            f"{ENGINE_KEY}.{key}={ours.get(key)!r}: {str(exc).splitlines()[0]}"
        ) from None
    return InferenceEngineConfig(**OmegaConf.to_container(merged))  # type: ignore[arg-type]


@dataclass
class RayGroupConfig:
    """One entry of `ray.groups`: the Ray options of a colocation group's actor."""

    num_cpus: float = 0.0
    """CPUs reserved for the actor."""
    num_gpus: float = 0.0
    """GPUs reserved for the actor."""
    max_concurrency: int | None = None
    """Threads of the actor; null: `ray.max_concurrency`."""
    max_restarts: int | None = None
    """Ray restarts of the actor; null: `ray.max_restarts`."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources (e.g. a node label) the actor needs."""


@dataclass
class RayRanksConfig:
    """`ray.train_ranks` and `ray.inference_replicas`: workers on bundles of their own."""

    bundles_per_node: list[int] = field(default_factory=list)
    """Bundles (one worker each) per node, e.g. `[2]`; empty: off."""
    num_cpus_per_bundle: float = 1.0
    """CPUs of each bundle."""
    num_gpus_per_bundle: float = 0.0
    """GPUs of each bundle (0: the workers run on CPUs)."""
    node_resources: list[dict[str, Any]] | None = None
    """Custom Ray resources per virtual node (e.g. a node label), one map per entry of
    `bundles_per_node`; null: none."""
