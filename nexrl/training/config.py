"""Configuration of the built-in torch train engine.

One dataclass with a docstring under each field, next to the engine it
configures. Loss settings (clip ranges, aggregation, KL coefficients) are not
here: they travel with each `train_batch` call, so the engine stays
algorithm-blind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

LR_SCHEDULES = ("constant", "cosine")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DP_STRATEGIES = ("ddp", "fsdp2")
LOGPROB_POSITIONS = ("all", "response")
LORA_DEFAULTS: dict[str, Any] = {
    "rank": 16,
    "alpha": 32,
    "target_modules": "all-linear",
    "dropout": 0.0,
}


@dataclass
class EngineConfig:
    lr: float = 3e-4
    """Peak learning rate. 3e-4 suits the tiny embedded model; use ~1e-6 for real LLMs."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Max global gradient norm; <= 0 disables clipping (the norm is still reported)."""
    lr_schedule: str = "constant"
    """"constant" (after warmup) or "cosine" (warmup, then cosine decay to min_lr_ratio * lr)."""
    warmup_steps: int = 0
    """Linear warmup steps from 0 to lr."""
    total_steps: int | None = None
    """Total optimizer steps; required by the cosine schedule."""
    min_lr_ratio: float = 0.0
    """Final lr of the cosine schedule, as a fraction of lr."""
    micro_batch_tokens: int = 8192
    """Token budget per micro-batch (real tokens, padding excluded); one row is always allowed."""
    use_packing: bool | None = None
    """Pack the rows of a micro-batch into one padding-free sequence (position_ids restart per
    row) - True; run padded rows with all-padding columns stripped per micro-batch - False.
    None (auto) packs only with a varlen attention kernel (attn_implementation
    "flash_attention_2"/"flash_attention_3"): with sdpa/eager a packed sequence needs a dense
    block-diagonal mask, quadratic in the packed length, which costs more than padding."""
    dtype: str = "auto"
    """Compute dtype: "auto" is float32 on CPU; on GPU, bfloat16 autocast for a micro-batch
    of at least 1e11 FLOPs of forward + backward (6 x parameters x tokens), float32 below
    (a small model's casts cost more than they save). Master weights and optimizer state
    stay float32."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (HF gradient checkpointing) to save memory."""
    logprob_chunk_tokens: int = 1024
    """Tokens per chunk of the output projection + log-softmax: the model runs without its
    head and only the positions needed are projected, this many at a time (recomputed in
    backward), so no (B, T, vocab) logits tensor exists. 0: one full-logits forward."""
    logprob_positions: str = "all"
    """Where compute_logprobs / compute_ref_logprobs / compute_entropy compute values: "all"
    real tokens, or "response" (the batch's loss_mask; 0 elsewhere; cheaper with a large
    vocabulary). train_batch always computes the loss's positions only."""
    release_host_memory: bool | None = None
    """After each update on a CPU, hand the memory the step freed back to the OS (glibc's
    malloc_trim; nexrl/host_memory.py), and (one rank) keep a step's gradients in one
    block, freed after the update. None (auto): on for models of 50M parameters or more
    (SmolLM2's recipe grew by 2-3 GB in three steps without it). Never on a GPU."""
    shared_prefix: bool | None = None
    """Run each distinct prompt once per micro-batch and share its key/value cache among
    the rows that start with it (a GRPO group), then run only the responses: same loss and
    gradients, fewer tokens through the model. True: on where it is exact and safe - one
    rank, padded (not packed) micro-batches, a plain linear head, full attention, no
    gradient checkpointing in training, a prefix shared by >= 2 rows - else the plain
    forward (warns once when the setup rules it out). None (auto): the same, where it also
    computes fewer padded tokens than the plain forward and, on a GPU, saves more arithmetic
    than its second forward costs in launches (6 x parameters x tokens saved >= 2e12, so
    not for tiny models). False: never."""
    lora: dict[str, Any] | None = None
    """Train a LoRA adapter (peft) instead of all weights: {rank: 16, alpha: 32,
    target_modules: "all-linear", dropout: 0.0}; weight exports are merged (base + LoRA)."""
    seed: int = 0
    """Seed of torch / python RNGs set at construction."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True); needed for bitwise-exact resume on GPU."""
    ref_model_path: str | None = None
    """Frozen reference model for KL (as `model_path`); null: the initial policy when the
    run uses KL (`algorithm.kl_in_reward_coef` or `loss_kwargs.kl_coef` > 0), else none."""
    entropy: bool = False
    """Compute per-token entropy in train_batch (also on when loss_kwargs has entropy_coef)."""
    dp_strategy: str = "ddp"
    """Data-parallel wrapper when WORLD_SIZE > 1: "ddp" or "fsdp2" (torch fully_shard)."""
    attn_implementation: str | None = None
    """HF attention backend ("sdpa", "eager", "flash_attention_2"); None lets HF choose."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Passed to from_pretrained as keyword arguments (e.g. trust_remote_code)."""
    threads: int | None = None
    """Torch threads of the thread that runs the update; null: 1 on a GPU; on a CPU,
    torch's count in a local sync run (the engine waits meanwhile), otherwise 1 for a
    model under 1M parameters (faster beside the engine, docs/training.md), else torch's
    count."""

    def __post_init__(self) -> None:
        _check_choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("dp_strategy", self.dp_strategy, DP_STRATEGIES)
        _check_choice("logprob_positions", self.logprob_positions, LOGPROB_POSITIONS)
        if self.logprob_chunk_tokens < 0:
            raise ValueError(
                f"engine config: logprob_chunk_tokens must be >= 0, got {self.logprob_chunk_tokens}"
            )
        if self.lora is not None:
            self.lora = _lora_options(self.lora)
        if self.lr_schedule == "cosine" and not self.total_steps:
            raise ValueError("engine config: lr_schedule='cosine' needs total_steps > 0")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"engine config: threads must be >= 1, got {self.threads}")
        if self.micro_batch_tokens <= 0:
            raise ValueError(
                f"engine config: micro_batch_tokens must be > 0, got {self.micro_batch_tokens}"
            )
        self.betas = (float(self.betas[0]), float(self.betas[1]))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | EngineConfig | None) -> EngineConfig:
        """Build from a dict / DictConfig; unknown keys fail naming the valid ones."""
        if isinstance(data, EngineConfig):
            return data
        data = dict(_to_plain(data or {}))
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown engine config key(s) {unknown}; valid keys: {sorted(names)}")
        if "betas" in data:
            data["betas"] = tuple(data["betas"])
        return cls(**data)

    def packing_enabled(self) -> bool:
        """Resolved `use_packing`."""
        if self.use_packing is not None:
            return bool(self.use_packing)
        return (self.attn_implementation or "").startswith("flash_attention")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _lora_options(data: Mapping[str, Any]) -> dict[str, Any]:
    """`lora` with defaults filled in; unknown keys and bad values fail naming the key."""
    data = dict(_to_plain(data))
    unknown = sorted(set(data) - set(LORA_DEFAULTS))
    if unknown:
        raise ValueError(
            f"unknown engine config lora key(s) {unknown}; valid keys: {sorted(LORA_DEFAULTS)}"
        )
    opts = {**LORA_DEFAULTS, **data}
    if int(opts["rank"]) <= 0:
        raise ValueError(f"engine config lora.rank must be > 0, got {opts['rank']}")
    if not 0 <= float(opts["dropout"]) < 1:
        raise ValueError(f"engine config lora.dropout must be in [0, 1), got {opts['dropout']}")
    targets = opts["target_modules"]
    opts["target_modules"] = targets if isinstance(targets, str) else list(targets)
    return opts


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"engine config {name}={value!r}; choose one of {list(choices)}")


def _to_plain(data: Mapping[str, Any]) -> Mapping[str, Any]:
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(data, DictConfig):
            return OmegaConf.to_container(data, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    return data
