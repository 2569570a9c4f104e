"""The data types of AReaL-lite's engine API (seed 004), as thin views of nexrl's.

`LLMRequest` / `LLMResponse` are the seed's request and response: a request
carries text *or* token ids (text is tokenized once, by the engine's tokenizer,
so the trajectory still holds the exact ids the engine saw) and converts to
nexrl's `GenerationRequest`; a response carries the sampled ids, their
logprobs and versions, and the decoded `completion`.

`WeightUpdateMeta` keeps the seed's fields (`type`, `path`, `alloc_mode`,
`comm_backend`) and adds the `version` the engine takes on. `SaveLoadMeta` and
`FinetuneSpec` are the seed's checkpoint and schedule descriptions.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from nexrl.inference.protocol import SamplingParams

AllocationMode = str
"""AReaL's placement string (e.g. `sglang.d2+fsdp.d2`). nexrl places engines from its
config (`ray.groups`, `ray.train_ranks`), so the in-process engines only carry it."""

WEIGHT_UPDATE_TYPES = ("disk", "memory")


@dataclass
class GenerationHyperparameters:
    """AReaL's `gconfig`: how to sample (`greedy` forces temperature 0)."""

    n_samples: int = 1
    max_new_tokens: int = 64
    min_new_tokens: int = 0
    greedy: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)

    def to_sampling(self) -> SamplingParams:
        if self.min_new_tokens:
            raise ValueError("gconfig.min_new_tokens is not supported by nexrl's engines; use 0")
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=0.0 if self.greedy else self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop_token_ids=list(self.stop_token_ids),
            stop=list(self.stop),
            n=self.n_samples,
        )


@dataclass
class LLMRequest:
    """One prompt as `text` (tokenized by the engine) or `input_ids`; `gconfig` samples."""

    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    text: str | None = None
    input_ids: list[int] = field(default_factory=list)
    gconfig: GenerationHyperparameters = field(default_factory=GenerationHyperparameters)
    metadata: dict[str, Any] = field(default_factory=dict)
    model_id: str | None = None


@dataclass
class LLMResponse:
    """The first sample of a request (`n_samples` > 1: the others are in `samples`).

    `completion` is the decoded text of `output_tokens`; `input_tokens` the prompt ids the
    engine saw (the tokenized `text` when the request had no ids)."""

    input_tokens: list[int]
    output_tokens: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    stop_reason: str
    completion: str = ""
    latency: float = 0.0
    samples: list[LLMResponse] = field(default_factory=list)

    @property
    def input_len(self) -> int:
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        return len(self.output_tokens)


@dataclass
class WeightUpdateMeta:
    """How new weights travel from a `TrainEngine` to an `InferenceEngine`.

    type: `disk` (an HF safetensors directory at `path`, written by `upload_weights`) or
        `memory` (the state dict handed over in this process). AReaL's `nccl` needs a
        GPU process group; nexrl's in-process engines reject it, naming these two.
    path: the directory of a `disk` update.
    alloc_mode, comm_backend: AReaL's placement and collective backend (carried, not used
        in-process: see `AllocationMode`).
    version: the weight version the inference engine takes on; None: its version + 1.
    """

    type: str = "disk"
    path: str | None = None
    alloc_mode: AllocationMode | None = None
    comm_backend: str | None = None
    version: int | None = None
    state_dict: dict[str, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.type not in WEIGHT_UPDATE_TYPES:
            raise ValueError(
                f"WeightUpdateMeta.type={self.type!r} is not supported here; use one of "
                f"{list(WEIGHT_UPDATE_TYPES)} (nccl needs a GPU process group; nexrl's "
                "equivalent is weight.transport=memory or file)"
            )
        if self.type == "disk" and not self.path:
            raise ValueError("WeightUpdateMeta(type='disk') needs `path`")


@dataclass
class SaveLoadMeta:
    """A checkpoint: `weight_format` `hf` (safetensors + config, loadable by transformers);
    `with_optim` adds optimizer, scheduler, RNG and step (nexrl's exact-resume checkpoint);
    `tokenizer` is saved beside the weights; `base_model_path` gives the config files."""

    path: str
    weight_format: str = "hf"
    with_optim: bool = False
    tokenizer: Any = None
    base_model_path: str | None = None

    def __post_init__(self) -> None:
        if self.weight_format != "hf":
            raise ValueError(
                f"SaveLoadMeta.weight_format={self.weight_format!r} is not supported; use 'hf' "
                "(with_optim=True gives nexrl's exact-resume checkpoint, its `dcp` equivalent)"
            )


@dataclass
class FinetuneSpec:
    """Training length, for the LR schedule: `total_train_steps` epochs x steps per epoch."""

    total_train_epochs: int
    dataset_size: int
    train_batch_size: int

    @property
    def steps_per_epoch(self) -> int:
        return max(1, self.dataset_size // self.train_batch_size)

    @property
    def total_train_steps(self) -> int:
        return self.total_train_epochs * self.steps_per_epoch
