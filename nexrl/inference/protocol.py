"""The inference-side process boundary (AReaL-lite's InferenceEngine shape).

An engine takes token ids in and gives token ids out, with the logprob of
every sampled token and the weight version that sampled it. Strings exist only
at the edges (the OpenAI server, reward functions); nothing between rollout
and training re-tokenizes.

Implementations: the built-in engine in this process, and remote engines over
HTTP (nexrl's server, vLLM, SGLang). Both satisfy `InferenceEngine`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypedDict, runtime_checkable

from nexrl.types import JSONDict, JSONValue

if TYPE_CHECKING:
    import torch
    from typing_extensions import TypeIs

TokenCallback = Callable[[int, int, float, int], None]
"""Streaming hook: `(sample_index, token_id, logprob, weight_version)` per sampled token,
called from the engine's scheduler thread (keep it cheap; hand the token to another thread)."""


class Decoder(Protocol):
    """What detokenizing code uses of a tokenizer."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...


class StreamingEngine(Protocol):
    """An engine that streams tokens (`Engine`, `ProcessEngine`): the OpenAI server's."""

    def submit(
        self, request: GenerationRequest, on_token: TokenCallback | None = None
    ) -> Future[GenerationResponse]: ...

    def abort(self, rid: str | None = None) -> None: ...


class SamplingKwargs(TypedDict, total=False):
    """The OpenAI-named sampling options `LLMServiceClient.completion` / `generate` take."""

    max_tokens: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int | None
    stop: str | list[str] | None
    stop_token_ids: list[int] | None
    n: int
    seed: int | None
    ignore_eos: bool
    rid: str | None
    cache_output: bool


class SampleResult(TypedDict, total=False):
    """One sample of a client result (`result["choices"][i]`)."""

    response: str
    response_ids: list[int]
    response_logprobs: list[float]
    finish_reason: str
    token_versions: list[int]
    retokenized: bool
    """A remote server sent no token ids: `response_ids` re-encode the text."""
    content: str | None
    tool_calls: list[dict[str, object]]
    parse_failures: list[str]
    scores: dict[str, float]
    """The reward's named components (set by the rollout worker that scored it)."""
    continuations: int
    """Requests that continued it after aborts (partial rollout)."""


class CompletionResult(SampleResult, total=False):
    """What `LLMServiceClient.completion` / `generate` answer: the first sample's fields at
    the top level, every sample in `choices`."""

    prompt: str | list[JSONDict] | None
    prompt_ids: list[int]
    model_version: int
    choices: list[SampleResult]
    messages: list[dict[str, object]]


@dataclass
class SamplingParams:
    """How to sample. `temperature == 0` means greedy."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    n: int = 1
    seed: int | None = None
    ignore_eos: bool = False  # vLLM's name: EOS does not end a sample (benchmarks)

    def to_kwargs(self) -> SamplingKwargs:
        """The client's OpenAI-named options (unset ones left out)."""
        out = SamplingKwargs(
            max_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            n=self.n,
        )
        if self.seed is not None:
            out["seed"] = self.seed
        if self.stop:
            out["stop"] = self.stop
        if self.stop_token_ids:
            out["stop_token_ids"] = self.stop_token_ids
        if self.ignore_eos:
            out["ignore_eos"] = True
        return out


@dataclass
class GenerationRequest:
    """One prompt, `sampling.n` samples. `rid` identifies it for abort.

    `cache_output`: keep each finished sample (prompt and reply) in the engine's prefix
    cache, so that a next turn quoting it skips their prefill. A caller that sends no
    next turn (single-turn rollouts) turns it off and saves the copy; the prompt is
    cached either way (the built-in engine; other engines ignore it)."""

    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str | None = None
    metadata: dict[str, JSONValue] = field(default_factory=dict)
    cache_output: bool = True


@dataclass
class GenerationOutput:
    """One sample. `output_versions[i]` is the weight version that sampled token i."""

    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    text: str = ""


@dataclass
class GenerationResponse:
    input_ids: list[int]
    outputs: list[GenerationOutput]
    rid: str | None = None


@dataclass
class WeightUpdateMeta:
    """Where new weights come from: a safetensors/HF directory, or a state dict in memory."""

    version: int
    path: str | None = None
    state_dict: dict[str, torch.Tensor] | None = None


@runtime_checkable
class InferenceEngine(Protocol):
    """What rollout code needs from an inference engine."""

    @property
    def version(self) -> int: ...

    async def agenerate(self, request: GenerationRequest) -> GenerationResponse: ...

    def generate(self, request: GenerationRequest) -> GenerationResponse:
        """Blocking form of `agenerate`, callable from any thread."""
        ...

    def update_weights(self, meta: WeightUpdateMeta) -> None: ...

    def pause(self) -> None:
        """Stop scheduling decode steps; running requests keep their state."""
        ...

    def resume(self) -> None: ...

    def abort(self, rid: str | None = None) -> None:
        """Finish running requests (all, or `rid`) now with finish_reason 'abort'."""
        ...

    def health(self) -> bool: ...

    def shutdown(self) -> None: ...


class ServedTokenizer(Decoder, Protocol):
    """What the OpenAI server types of an HF tokenizer (the rest goes to HF calls)."""

    def __len__(self) -> int: ...


class ServedEngine(InferenceEngine, Protocol):
    """An engine the OpenAI server can serve: it renders prompts with the engine's tokenizer."""

    @property
    def tokenizer(self) -> ServedTokenizer: ...


def serves_text(engine: InferenceEngine) -> TypeIs[ServedEngine]:
    """True when `engine` has a tokenizer (every local engine; not a bare token-id engine)."""
    return getattr(engine, "tokenizer", None) is not None


def streams_tokens(engine: object) -> TypeIs[StreamingEngine]:
    """True when `engine` streams tokens: it says so (`supports_streaming`) and has `submit`."""
    return bool(getattr(engine, "supports_streaming", False)) and callable(
        getattr(engine, "submit", None)
    )
