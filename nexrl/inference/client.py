"""`LLMServiceClient`: what rollout workers hold to reach the policy (seed 000).

Two transports behind one surface:

- in-process (`backend: builtin | hf`): the engine of this process, shared by
  every client with the same `model_tag` (`get_local_engine`);
- remote (`backend: remote | vllm | sglang`): any OpenAI-compatible server,
  through the official `openai` SDK; weight updates, pause and abort go
  through a small per-server HTTP adapter (`nexrl.inference.remote`).

The client adds retries (tenacity), weight-sync blocking and the result dict;
it holds no algorithm logic. Results are token-in/token-out: `prompt_ids`,
`response_ids`, `response_logprobs` exactly as the engine saw and produced.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
import uuid
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, TypeVar

from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from nexrl.config.derived import LOCAL_BACKENDS
from nexrl.config.schema import InferenceServiceConfig
from nexrl.execute import execute
from nexrl.inference.factory import build_local_engine, check_engine_options, engine_identity
from nexrl.inference.protocol import (
    CompletionResult,
    GenerationRequest,
    GenerationResponse,
    InferenceEngine,
    SampleResult,
    SamplingKwargs,
    SamplingParams,
    WeightUpdateMeta,
)
from nexrl.inference.sampler import encode_text

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from nexrl.inference.remote import RemoteBackend
    from nexrl.protocols import WeightSyncLike

_T = TypeVar("_T")
REMOTE_BACKENDS = ("remote", "vllm", "sglang")
_BLOCK_POLL_S = 0.02
RECENT_SAMPLES = 256
FIRST_RETRY_WAIT_S, MAX_RETRY_WAIT_S = 0.1, 2.0  # transport retries: 0.1, 0.2, 0.4 ... 2 s

_local_engines: dict[str, InferenceEngine] = {}
_local_identities: dict[str, dict[str, object]] = {}
_local_lock = threading.Lock()


def _cfg(config: Mapping, key: str, default: Any = None) -> Any:
    value = config.get(key, default) if config is not None else default
    return default if value is None else value


def create_engine(config: Mapping) -> InferenceEngine:
    """A new in-process engine for `config` (`backend` builtin or hf), or, in Ray mode with
    `replica_actors`, a balancer over the replica actors' engines (docs/ray.md)."""
    if config.get("replica_actors"):
        from nexrl.inference.replicas import ReplicaBalancer

        return ReplicaBalancer.connect(config)
    return build_local_engine(config)


def get_local_engine(config: Mapping) -> InferenceEngine:
    """The process-wide engine for `config['model_tag']`, created on first use (thread-safe)."""
    tag = _cfg(config, "model_tag", "default")
    identity = engine_identity(config)
    with _local_lock:
        if tag not in _local_engines:
            _local_engines[tag] = create_engine(config)
            _local_identities[tag] = identity
        elif identity != _local_identities[tag]:
            _warn_shared_engine(tag, _local_identities[tag], identity)
        return _local_engines[tag]


def _warn_shared_engine(tag: str, first: dict[str, object], asked: dict[str, object]) -> None:
    keys = sorted(k for k in first.keys() | asked.keys() if first.get(k) != asked.get(k))
    diff = ", ".join(f"{k}={asked.get(k)!r} (running: {first.get(k)!r})" for k in keys)
    warnings.warn(
        f"model_tag {tag!r}: this process already runs that engine with other settings, and "
        f"this client shares it: {diff}. Give the client its own model_tag for an engine of "
        "its own.",
        stacklevel=3,
    )


def shutdown_local_engines() -> None:
    """Stop and forget every process-wide engine (tests, process exit)."""
    with _local_lock:
        for engine in _local_engines.values():
            engine.shutdown()
        _local_engines.clear()
        _local_identities.clear()
    if "nexrl.inference.vllm_server" in sys.modules:  # managed vLLM servers of the run
        sys.modules["nexrl.inference.vllm_server"].shutdown_servers()


def sampling_from_kwargs(kwargs: SamplingKwargs) -> SamplingParams:
    """OpenAI-named kwargs (max_tokens, temperature, top_p, top_k, stop, ...) -> SamplingParams."""
    stop = kwargs.get("stop") or []
    return SamplingParams(
        max_new_tokens=int(kwargs.get("max_tokens", kwargs.get("max_new_tokens", 64))),
        temperature=float(kwargs.get("temperature", 1.0)),
        top_p=float(kwargs.get("top_p", 1.0)),
        top_k=int(top_k) if (top_k := kwargs.get("top_k")) is not None else -1,
        stop_token_ids=list(kwargs.get("stop_token_ids") or []),
        stop=[stop] if isinstance(stop, str) else list(stop),
        n=int(kwargs.get("n", 1)),
        seed=kwargs.get("seed"),
        ignore_eos=bool(kwargs.get("ignore_eos", False)),
    )


class SampleText(str):
    """A sample's text as the client returns it (`result["response"]`): a `str` that names
    its sample (`sample_id`), so that a trajectory written with this text only is completed
    with this sample's token ids (`LLMServiceClient.sample_of`). A `str` subclass is never
    interned: two samples that both answer "" or "7" are two objects with two ids (plain
    empty and one-character strings are one shared object each in CPython)."""

    sample_id: str

    def __new__(cls, text: str, sample_id: str) -> SampleText:
        obj = super().__new__(cls, text)
        obj.sample_id = sample_id
        return obj

    def __reduce__(self) -> tuple[type[SampleText], tuple[str, str]]:
        return (SampleText, (str(self), self.sample_id))


def result_dict(prompt: str | None, response: GenerationResponse, version: int) -> CompletionResult:
    """The client's result: top level = first choice, `choices` = every sample."""
    choices: list[SampleResult] = [
        {
            "response": out.text,
            "response_ids": list(out.output_ids),
            "response_logprobs": list(out.output_logprobs),
            "finish_reason": out.finish_reason,
            "token_versions": list(out.output_versions),
        }
        for out in response.outputs
    ]
    return {
        "prompt": prompt,
        "prompt_ids": list(response.input_ids),
        **choices[0],
        "model_version": version,
        "choices": choices,
    }


def as_inference_config(config: InferenceServiceConfig | Mapping) -> InferenceServiceConfig:
    """The typed `service.inference_service` section. A flat mapping (the section with its
    `engine` options merged in, as `nexrl.builders.inference_config` makes) is split back:
    section keys go to their fields, every other key is an engine option."""
    if isinstance(config, InferenceServiceConfig):
        return config
    raw = {k: v for k, v in dict(config or {}).items() if v is not None}
    fields = set(InferenceServiceConfig.__dataclass_fields__) - {"engine"}
    engine = {**dict(raw.pop("engine", None) or {})}
    engine.update({k: v for k, v in raw.items() if k not in fields})
    return InferenceServiceConfig(**{k: v for k, v in raw.items() if k in fields}, engine=engine)


class LLMServiceClient:
    """Client for the `service.inference_service` config section (see docs/inference.md)."""

    def __init__(
        self, config: InferenceServiceConfig | Mapping, engine: InferenceEngine | None = None
    ) -> None:
        section = as_inference_config(config)
        self.config = {**asdict(section), **section.engine}
        self.config.pop("engine", None)
        self.backend: str = section.backend
        if self.backend not in LOCAL_BACKENDS + REMOTE_BACKENDS:
            raise ValueError(
                f"service.inference_service.backend={self.backend!r}; "
                f"choose one of {LOCAL_BACKENDS + REMOTE_BACKENDS}"
            )
        self._model_tag: str = section.model_tag
        self.max_retries = section.max_retries
        # the HTTP clients' errors only for a remote engine: a local run then never imports
        # the openai SDK (0.3 s of a fresh run's start-up on 2 CPU cores)
        transient: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError)
        if self.backend in REMOTE_BACKENDS:
            transient += _remote_errors()
        self._transient = transient
        # after a first try that failed: the remaining `max_retries`, each wait the one the
        # same attempt would have had counting the first (0.1 s x 2^(n-1), at most 2 s)
        self._retryer = Retrying(  # one for all calls: its per-call state is thread-local
            stop=stop_after_attempt(self.max_retries),
            wait=wait_exponential(multiplier=2 * FIRST_RETRY_WAIT_S, max=MAX_RETRY_WAIT_S),
            retry=retry_if_exception_type(transient),
            reraise=True,
        )
        self.freeze_for_weight_sync = section.freeze_for_weight_sync
        # sample_id -> (shared, choice) of the latest samples (see `_record`)
        self._recent: OrderedDict[str, tuple[dict[str, object], SampleResult]] = OrderedDict()
        self._recent_lock = threading.Lock()
        self._sample_ids = (f"{uuid.uuid4().hex[:12]}-{n}" for n in itertools.count())
        self._controller: WeightSyncLike | None = None
        self._engine: InferenceEngine | None = None
        self._remote: RemoteBackend | None = None
        if self.backend in LOCAL_BACKENDS:
            check_engine_options(section.engine)
            self._engine = engine or get_local_engine(self.config)
        else:
            from nexrl.inference.remote import RemoteBackend

            if self.backend == "vllm":
                from nexrl.inference.vllm_server import check_vllm_options

                check_vllm_options(section.engine)
            self._remote = RemoteBackend(self.config)

    # -- properties -------------------------------------------------------------------------
    @property
    def model_tag(self) -> str:
        return self._model_tag

    @property
    def _backend(self) -> InferenceEngine | RemoteBackend:
        """The local engine, else the remote one (`__init__` always sets one of them)."""
        if self._engine is not None:
            return self._engine
        assert self._remote is not None
        return self._remote

    @property
    def _local(self) -> InferenceEngine:
        if self._engine is None:
            raise RuntimeError(f"backend {self.backend!r} has no local engine")
        return self._engine

    @property
    def version(self) -> int:
        return self._backend.version

    @property
    def tokenizer(self):
        if self._engine is not None:
            return self._engine.tokenizer
        return self._remote.tokenizer

    # -- generation -------------------------------------------------------------------------
    def completion(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: list[int] | None = None,
        **kwargs: Unpack[SamplingKwargs],
    ) -> CompletionResult:
        """Complete `prompt` (text) or `prompt_ids` (token ids). kwargs use OpenAI names."""
        if (prompt is None) == (prompt_ids is None):
            raise ValueError("completion() needs exactly one of `prompt` or `prompt_ids`")
        self._wait_for_weight_sync()
        if self._remote is not None:
            return self._record(self._retrying(self._remote.completion, prompt, prompt_ids, kwargs))
        if prompt_ids is None:
            assert prompt is not None  # exactly one of the two, checked above
            prompt_ids = self._encode(prompt)
        return self._record(self._retrying(self._local_generate, prompt, prompt_ids, kwargs))

    def _record(self, result: CompletionResult) -> CompletionResult:
        """Keep the latest samples (token ids, logprobs, versions) by sample id, so that a
        trajectory written with response text only can be completed token-exactly: each
        choice's `response` becomes a `SampleText` naming its sample (the top level's is
        the first choice's object)."""
        shared: dict[str, object] = {k: v for k, v in result.items() if k != "choices"}
        # (shared, choice) pairs, merged when read: most runs never read them
        choices = result.get("choices") or []
        with self._recent_lock:
            for choice in choices:
                sid = next(self._sample_ids)
                if isinstance(choice.get("response"), str):
                    choice["response"] = SampleText(choice["response"], sid)
                self._recent[sid] = (shared, choice)
            while len(self._recent) > RECENT_SAMPLES:
                self._recent.popitem(last=False)
        if choices:
            result["response"] = choices[0]["response"]
        return result

    def recent_samples(self) -> list[dict[str, object]]:
        """The latest samples this client returned, oldest first."""
        with self._recent_lock:
            pairs = list(self._recent.values())
        return [{**shared, **choice} for shared, choice in pairs]

    def sample_of(self, response: object) -> dict[str, object] | None:
        """The recent sample whose `response` this is (the `SampleText` object this client
        returned, or one pickled from it), or None: text that is only equal to a sample's,
        a sample of another client, or one older than the last `RECENT_SAMPLES`."""
        sid = getattr(response, "sample_id", None)
        with self._recent_lock:
            pair = self._recent.get(sid) if isinstance(sid, str) else None
        return None if pair is None else {**pair[0], **pair[1]}

    def generate(
        self,
        messages: list[dict[str, object]],
        *,
        tools: list[dict[str, object]] | None = None,
        **kwargs: Unpack[SamplingKwargs],
    ) -> CompletionResult:
        """Chat: apply the tokenizer's chat template (with `tools` when given), then complete.

        Adds `messages` and, per choice, the OpenAI `tool_calls` of the reply ([] when it
        called none; `content` is then the text outside the calls). Local backends parse
        with `tool_call_parser`; remote ones send `tools` to the server and read its
        `message.tool_calls` back (start `nexrl serve` with `--tool-call-parser`)."""
        self._wait_for_weight_sync()
        if self._remote is not None:
            result = self._retrying(self._remote.chat, messages, kwargs, tools)
        else:
            from nexrl.agents.chat import warn_if_template_drops

            warn_if_template_drops(self.tokenizer, messages, tools)
            ids = self.tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            prompt = self.tokenizer.decode(ids)
            result = self._retrying(self._local_generate, prompt, list(ids), kwargs)
            if tools:
                self._parse_tool_calls(result)
        result["messages"] = messages
        for choice in result["choices"]:
            choice.setdefault("tool_calls", [])
        result.setdefault("tool_calls", result["choices"][0]["tool_calls"])
        return self._record(result)

    def _parse_tool_calls(self, result: CompletionResult) -> None:
        """OpenAI `tool_calls` of each local choice, as `nexrl serve` returns them."""
        from nexrl.inference.api_models import assistant_message
        from nexrl.inference.tool_parsers import get_parser

        parser = get_parser(self.config.get("tool_call_parser") or "hermes")
        for choice in result["choices"]:
            parsed = parser.parse(choice["response"])
            message, finish = assistant_message(choice["response"], choice["finish_reason"], parsed)
            choice["content"] = message["content"]
            choice["tool_calls"] = message.get("tool_calls", [])
            choice["finish_reason"] = finish
            choice["parse_failures"] = [f.reason for f in parsed[2]]
        first = result["choices"][0]
        result["content"] = first["content"]
        result["tool_calls"] = first["tool_calls"]
        result["finish_reason"] = first["finish_reason"]
        result["parse_failures"] = first["parse_failures"]

    def _local_generate(
        self, prompt: str | None, ids: list[int], kwargs: SamplingKwargs
    ) -> CompletionResult:
        engine = self._local
        version = engine.version
        request = GenerationRequest(
            list(ids),
            sampling_from_kwargs(kwargs),
            rid=kwargs.get("rid"),
            cache_output=bool(kwargs.get("cache_output", True)),
        )
        response = engine.generate(request)
        return result_dict(prompt, response, version)

    def _encode(self, prompt: str) -> list[int]:
        return encode_text(self.tokenizer, prompt)

    def _retrying(self, fn: Callable[..., _T], *args: object) -> _T:
        """Call `fn`, retrying transport errors (never ValueError: a bad request stays bad).

        The first try is a plain call: tenacity's bookkeeping costs ~14 us a call (Zen 4),
        held under the interpreter lock, and every rollout request (a group, an agent's
        turn) makes one."""
        try:
            return fn(*args)
        except self._transient as exc:
            if self.max_retries < 1:
                raise self._gone(exc) from exc
        time.sleep(FIRST_RETRY_WAIT_S)
        try:
            return self._retryer(fn, *args)
        except self._transient as exc:
            raise self._gone(exc) from exc

    def _gone(self, exc: BaseException) -> BaseException:
        """A transport error of a remote server as one line naming its URL and what to
        check (a local engine's error is returned as it is)."""
        if self._remote is None:
            return exc
        return ConnectionError(
            f"inference server {self._remote.base} did not answer after "
            f"{max(self.max_retries, 1)} tries ({type(exc).__name__}: {exc}); check that it "
            "is still running (nexrl serve, its log), that the host and port are reachable "
            "from here, and service.inference_service.url"
        )

    # -- weight sync ------------------------------------------------------------------------
    def set_weight_sync_controller(self, controller: WeightSyncLike | None) -> None:
        """Requests wait while `controller` says a push holds them (`freeze_for_weight_sync`)."""
        self._controller = controller

    def _wait_for_weight_sync(self) -> None:
        if self._controller is None or not self.freeze_for_weight_sync:
            return
        check = self._controller.check_rollout_service_status
        while execute(check, self._model_tag) == "block":
            time.sleep(_BLOCK_POLL_S)

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        self._control(self._backend.update_weights, meta)

    def pause(self) -> None:
        self._control(self._backend.pause)

    def resume(self) -> None:
        self._control(self._backend.resume)

    def abort(self, rid: str | None = None) -> None:
        self._control(self._backend.abort, rid)

    def _control(self, fn: Callable[..., object], *args: object) -> None:
        try:
            fn(*args)
        except self._transient as exc:  # no retry: a control call may not be idempotent
            raise self._gone(exc) from exc


def _remote_errors() -> tuple[type[BaseException], ...]:
    import httpx
    import openai

    return (
        openai.APIConnectionError,
        openai.APITimeoutError,
        openai.InternalServerError,
        httpx.TransportError,
    )
