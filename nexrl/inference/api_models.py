"""Request bodies and response builders of nexrl's OpenAI-compatible server.

Field names follow OpenAI where it defines them and vLLM / SGLang where they
extend it (`top_k`, `stop_token_ids`, `prompt_token_ids`, `token_ids`,
`rid`), so any OpenAI client works and token-in/token-out clients find the
ids where they look for them. nexrl adds `weight_version` (the version at the
start of generation) and per-choice `token_versions`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from nexrl.inference.protocol import GenerationResponse, SamplingParams


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    rid: str | None = None
    ignore_eos: bool = False

    def sampling(self, default_max: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_new_tokens=default_max if self.max_tokens is None else self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop_token_ids=list(self.stop_token_ids or []),
            stop=stop,
            n=self.n,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        ..., description="text, token ids, or a list of either (several prompts)"
    )
    logprobs: int | None = None
    echo: bool = False


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None


class UpdateWeightsRequest(BaseModel):
    """SGLang's `/update_weights_from_disk` body, plus our integer `version`."""

    model_config = ConfigDict(extra="allow")

    model_path: str
    version: int | None = None
    weight_version: str | int | None = None
    load_format: str | None = None


class AbortRequest(BaseModel):
    rid: str | None = None
    abort_all: bool = False


def _usage(prompt_len: int, resp: GenerationResponse) -> dict[str, int]:
    completion = sum(len(o.output_ids) for o in resp.outputs)
    return {
        "prompt_tokens": prompt_len,
        "completion_tokens": completion,
        "total_tokens": prompt_len + completion,
    }


_ID_PREFIX = {
    "text_completion": "cmpl",
    "chat.completion": "chatcmpl",
    "chat.completion.chunk": "chatcmpl",
}


def response_header(obj: str, rid: str | None, model: str, version: int) -> dict[str, Any]:
    """Fields every response (and every streamed chunk of it) starts with."""
    return {
        "id": f"{_ID_PREFIX[obj]}-{rid or uuid.uuid4().hex}",
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "weight_version": version,
    }


def _tail(resp: GenerationResponse, choices: list[dict[str, Any]]) -> dict[str, Any]:
    usage = _usage(len(resp.input_ids), resp)
    return {"choices": choices, "prompt_token_ids": resp.input_ids, "usage": usage}


def completion_body(
    resp: GenerationResponse, model: str, version: int, tokenizer, logprobs: int | None
) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(resp.outputs):
        lp = None
        if logprobs is not None:
            lp = _completion_logprobs(tokenizer, out.output_ids, out.output_logprobs)
        choices.append(
            {
                "index": i,
                "text": out.text,
                "finish_reason": out.finish_reason,
                "logprobs": lp,
                "prompt_token_ids": resp.input_ids,
                "token_ids": out.output_ids,
                "token_versions": out.output_versions,
            }
        )
    return {**response_header("text_completion", resp.rid, model, version), **_tail(resp, choices)}


def chat_body(
    resp: GenerationResponse, model: str, version: int, tokenizer, logprobs: bool
) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(resp.outputs):
        lp = _chat_logprobs(tokenizer, out.output_ids, out.output_logprobs) if logprobs else None
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": out.text},
                "finish_reason": out.finish_reason,
                "logprobs": lp,
                "token_ids": out.output_ids,
                "token_versions": out.output_versions,
            }
        )
    return {**response_header("chat.completion", resp.rid, model, version), **_tail(resp, choices)}


def _completion_logprobs(tokenizer, ids: list[int], lps: list[float]) -> dict[str, Any]:
    toks = tokenizer.convert_ids_to_tokens(ids)
    return {
        "tokens": toks,
        "token_logprobs": lps,
        "top_logprobs": [{t: v} for t, v in zip(toks, lps, strict=True)],
        "text_offset": [],
    }


def _chat_logprobs(tokenizer, ids: list[int], lps: list[float]) -> dict[str, Any]:
    toks = tokenizer.convert_ids_to_tokens(ids)
    return {
        "content": [
            {"token": t, "logprob": v, "bytes": list(t.encode()), "top_logprobs": []}
            for t, v in zip(toks, lps, strict=True)
        ]
    }


# -- streaming chunks (nexrl/inference/streaming.py) -------------------------------------------
def completion_chunk_fn(header: dict[str, Any], tokenizer, logprobs: int | None):
    """Builds one `text_completion` chunk per (sample, new tokens)."""

    def make(index: int, text: str, ids: list[int], lps: list[float], finish: str | None):
        lp = _completion_logprobs(tokenizer, ids, lps) if logprobs is not None and ids else None
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        return {**header, "choices": [{**choice, "token_ids": ids}]}

    return make


def chat_chunk_fn(header: dict[str, Any], tokenizer, logprobs: bool):
    """Builds one `chat.completion.chunk` per (sample, new tokens); the first has the role."""
    started: set[int] = set()

    def make(index: int, text: str, ids: list[int], lps: list[float], finish: str | None):
        delta: dict[str, Any] = {"content": text}
        if index not in started:
            started.add(index)
            delta["role"] = "assistant"
        lp = _chat_logprobs(tokenizer, ids, lps) if logprobs and ids else None
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {**header, "choices": [{**choice, "token_ids": ids}]}

    return make


def usage_chunk_fn(header: dict[str, Any]):
    def make(resp: GenerationResponse) -> dict[str, Any]:
        return {**header, "choices": [], "usage": _usage(len(resp.input_ids), resp)}

    return make
